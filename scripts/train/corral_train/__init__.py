"""Corral's own small model: corpus, tokenizer, chat data, training and export."""
