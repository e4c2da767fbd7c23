//! Constrained decoding: a request's output held to a JSON schema or a Lark grammar by
//! llguidance, which computes each step's allowed tokens from the tokenizer's trie. The mask
//! for the next token is computed on a thread of its own while the step's forward runs; the
//! sampler waits for it only if the forward finished first.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::SimpleVob;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::EngineError;

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A JSON document valid against this JSON schema (`{"type": "object"}` for any object).
    JsonSchema(Value),
    /// Text the Lark grammar (llguidance's dialect, `%json` included) accepts.
    Lark(String),
}

/// Compiles grammars for one tokenizer; built once per model, shared by the requests.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// A compiler for `tokenizer`, whose `eos` ids (the request's stop ids) end an accepted
    /// document.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer, eos: &[u32]) -> Result<Self, EngineError> {
        let bad = |e: &dyn std::fmt::Display| EngineError::Grammar(format!("tokenizer: {e}"));
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(tokenizer.clone())
            .map_err(|e| bad(&e))?;
        // Ids past the tokenizer's vocabulary (a model's config naming tokens this tokenizer
        // lacks) cannot end a document here; the library refuses them by panicking.
        let vocab = bytes.tokrx_info().vocab_size;
        let eos: Vec<u32> = eos.iter().copied().filter(|&t| t < vocab).collect();
        if !eos.is_empty() {
            bytes.set_eos_tokens(&eos);
        }
        let env = bytes.into_tok_env(None).map_err(|e| bad(&e))?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| bad(&e))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// Whether `text` (`<tool_call>`, `</think>`) is one special token of the vocabulary
    /// (llguidance counts every added token of the form `<...>` as one): a grammar names
    /// it as `<tool_call>`, not as the quoted text.
    pub fn is_special_token(&self, text: &str) -> bool {
        self.factory
            .tok_env()
            .tok_trie()
            .get_special_token(text)
            .is_some()
    }

    /// The constraint for one request, its first mask already being computed.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, EngineError> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(json_style(schema, false))
            }
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        // A schema the library cannot handle must not take the caller down with it.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(top)
        }))
        .map_err(|_| EngineError::Grammar("grammar: the compiler failed on it".to_string()))?
        .map_err(|e| EngineError::Grammar(format!("grammar: {e}")))?;
        let mut constraint = Constraint {
            state: State::Idle(Box::new(Matcher::new(Ok(parser)))),
            stats: ConstraintStats::default(),
            worker: None,
        };
        constraint.start_mask();
        Ok(constraint)
    }
}

/// `schema` with llguidance's options for how the JSON is written: as transformers'
/// templates and OpenAI's models write it (`", "`, `": "`), with no freedom in whitespace (a
/// model cannot wander in it); `lenient`: schema keywords llguidance does not enforce are
/// ignored rather than refused (for tool schemas written for other engines). A schema that
/// sets its own `x-guidance` options keeps them.
pub fn json_style(schema: &Value, lenient: bool) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".to_string(),
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
                "lenient": lenient,
            }),
        );
    }
    schema
}

/// Time a request's constraint took, over its generated tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ConstraintStats {
    /// Masks computed.
    pub masks: usize,
    /// Time computing them (beside the forward).
    pub compute: Duration,
    /// Time the sampler waited for them (on the step's path).
    pub wait: Duration,
}

enum State {
    Idle(Box<Matcher>),
    /// The matcher is with the worker, computing the next mask.
    Computing,
    Failed(String),
}

type Computed = (Box<Matcher>, Result<SimpleVob, String>, Duration);

/// The thread that computes one request's masks, beside the forward, for the request's life:
/// it takes the matcher, and gives it back with the mask.
struct MaskWorker {
    jobs: Sender<Box<Matcher>>,
    done: Receiver<Computed>,
}

impl MaskWorker {
    fn spawn() -> std::io::Result<Self> {
        let (jobs, todo) = channel::<Box<Matcher>>();
        let (finished, done) = channel();
        std::thread::Builder::new()
            .name("grammar-mask".to_string())
            .spawn(move || {
                // Ends when the constraint is dropped (its sender with it).
                for mut matcher in todo {
                    let start = Instant::now();
                    let mask = matcher.compute_mask().map_err(|e| e.to_string());
                    if finished.send((matcher, mask, start.elapsed())).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self { jobs, done })
    }
}

/// One request's grammar state and its next token's mask.
pub struct Constraint {
    state: State,
    stats: ConstraintStats,
    worker: Option<MaskWorker>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Starts computing the next mask on the request's worker thread (started the first time).
    fn start_mask(&mut self) {
        let State::Idle(matcher) = std::mem::replace(&mut self.state, State::Computing) else {
            return;
        };
        if self.worker.is_none() {
            match MaskWorker::spawn() {
                Ok(w) => self.worker = Some(w),
                Err(e) => {
                    self.state =
                        State::Failed(format!("constrained decoding: no thread for the mask: {e}"));
                    return;
                }
            }
        }
        let sent = self.worker.as_ref().map(|w| w.jobs.send(matcher));
        if !matches!(sent, Some(Ok(()))) {
            self.state = State::Failed("constrained decoding: the mask's thread ended".to_string());
        }
    }

    /// Sets every logit the grammar does not allow next to −∞ (ids past the tokenizer's
    /// vocabulary included), waiting for the mask if it is still being computed.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<(), String> {
        match std::mem::replace(&mut self.state, State::Failed(String::new())) {
            State::Computing => {}
            State::Failed(e) => return Err(self.fail(e)),
            State::Idle(_) => return Err(self.fail("no mask was computed".to_string())),
        }
        let waited = Instant::now();
        let received = match &self.worker {
            Some(w) => w.done.recv().ok(),
            None => None,
        };
        self.stats.wait += waited.elapsed();
        let Some((matcher, mask, took)) = received else {
            return Err(self.fail("the mask's thread ended".to_string()));
        };
        self.stats.masks += 1;
        self.stats.compute += took;
        let mask = mask.map_err(|e| self.fail(e))?;
        self.state = State::Idle(matcher);
        apply_mask(&mask, logits);
        Ok(())
    }

    /// Advances the grammar over the sampled `token`; true when it is complete (nothing may
    /// follow but the end), else the next mask starts.
    pub fn accept(&mut self, token: u32) -> Result<bool, String> {
        let State::Idle(matcher) = &mut self.state else {
            return Err(self.fail("a token came before its mask".to_string()));
        };
        if let Err(e) = matcher.consume_token(token) {
            return Err(self.fail(e.to_string()));
        }
        match matcher.stop_reason() {
            StopReason::NotStopped => {}
            StopReason::NoExtension | StopReason::NoExtensionBias | StopReason::EndOfSentence => {
                return Ok(true);
            }
            other => return Err(self.fail(format!("the grammar stopped: {other}"))),
        }
        self.start_mask();
        Ok(false)
    }

    /// Time the constraint took so far.
    pub fn stats(&self) -> ConstraintStats {
        self.stats
    }

    fn fail(&mut self, error: String) -> String {
        let message = if error.starts_with("constrained decoding: ") {
            error
        } else {
            format!("constrained decoding: {error}")
        };
        self.state = State::Failed(message.clone());
        message
    }
}

/// Sets every logit `mask` does not allow to −∞ (ids past its length included), a word of 32
/// ids at a time: a word of all allowed ids (most of a JSON string's) is passed over whole.
fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    let (words, size) = (mask.as_slice(), mask.len());
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX && (w + 1) * 32 <= size {
            continue;
        }
        for (b, logit) in chunk.iter_mut().enumerate() {
            if w * 32 + b >= size || bits & (1 << b) == 0 {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Word by word, the mask leaves exactly the logits the grammar allows (the id-by-id
        /// reading), over masks of any length against logits longer or shorter than them,
        /// with whole words allowed, none allowed, and mixed.
        #[test]
        fn a_mask_applied_word_by_word_equals_it_read_id_by_id(
            size in 0usize..200, extra in 0usize..70, short in 0usize..40,
            words in proptest::collection::vec(
                proptest::prop_oneof![proptest::strategy::Just(u32::MAX), proptest::strategy::Just(0u32), proptest::prelude::any::<u32>()],
                7,
            ),
        ) {
            let mut mask = SimpleVob::alloc(size);
            for id in 0..size {
                if words[id / 32] & (1 << (id % 32)) != 0 {
                    mask.allow_token(id as u32);
                }
            }
            let n = (size + extra).saturating_sub(short);
            let mut ours: Vec<f32> = (0..n).map(|i| i as f32).collect();
            apply_mask(&mask, &mut ours);
            for (id, logit) in ours.iter().enumerate() {
                let allowed = id < mask.len() && mask.is_allowed(id as u32);
                proptest::prop_assert_eq!(*logit == id as f32, allowed, "id {}", id);
                proptest::prop_assert!(allowed || *logit == f32::NEG_INFINITY);
            }
        }
    }

    fn tokenizer() -> tokenizers::Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/tiny-qwen3-moe/tokenizer.json"
        );
        tokenizers::Tokenizer::from_file(path).unwrap()
    }

    #[test]
    fn end_ids_past_the_vocabulary_are_left_out_not_a_panic() {
        let tok = tokenizer();
        let inside = tok.token_to_id("<|im_end|>").unwrap();
        for eos in [vec![151_645], vec![inside, 248_044], vec![]] {
            let compiler = GrammarCompiler::new(&tok, &eos).unwrap();
            compiler
                .compile(&Grammar::JsonSchema(serde_json::json!({"type": "object"})))
                .unwrap();
        }
    }

    #[test]
    fn a_bad_grammar_is_an_error() {
        let compiler = GrammarCompiler::new(&tokenizer(), &[]).unwrap();
        assert!(
            compiler
                .compile(&Grammar::Lark("start: (".to_string()))
                .is_err()
        );
        assert!(
            compiler
                .compile(&Grammar::JsonSchema(
                    serde_json::json!({"type": "no-such-type"})
                ))
                .is_err()
        );
    }
}
