//! The output step: a step's logits rows become each run's tokens (sampled on the host, or
//! reduced on the device), held to the run's grammar and stop ids, sent to its client, and
//! its end counted; one place for all of a request's events.

use super::*;

impl Scheduler {
    /// Takes the logits of a step (one row per run that wanted them, in plan order), samples,
    /// streams tokens to their clients and retires finished sequences.
    pub fn finish_step(
        &mut self,
        plan: StepPlan,
        logits: &mut [f32],
        vocab: usize,
        stats: DispatchStats,
    ) -> StepCounts {
        self.finish(plan, StepLogits::Whole(logits, vocab), stats)
    }

    /// Fills `step` with the sampling of `plan`'s logits rows, for the device to reduce them
    /// ([`corral_model::Model::forward_sampled`]); false, touching nothing, if a row needs its
    /// whole logits (a top-k beyond the device's candidates, log-probabilities before
    /// penalties): then the step reads them back whole for [`Scheduler::finish_step`].
    pub fn prepare_sampling(
        &mut self,
        plan: &StepPlan,
        vocab: usize,
        step: &mut SampledStep,
    ) -> bool {
        if vocab > MAX_REDUCED_VOCAB {
            return false;
        }
        let index = |running: &[Sequence], id: SeqId| running.iter().position(|s| s.id == id);
        let wanted = plan.runs.iter().filter(|r| r.logits > 0);
        // A draft's rows are reduced together; a row whose sampling depends on the tokens
        // before it (a grammar's mask, penalties) is sampled on the host after the draft
        // tokens before it were accepted.
        if wanted.clone().any(|r| {
            index(&self.running, r.seq).is_some_and(|i| {
                let seq = &self.running[i];
                seq.constraint.is_some()
                    || seq.sampler.needs_whole_logits(seq.top_logprobs)
                    || (r.logits > 1 && seq.sampler.has_penalties())
            })
        }) {
            return false;
        }
        step.rows.clear();
        step.penalties.clear();
        step.logprobs.clear();
        let rows = wanted.flat_map(|run| std::iter::repeat_n(run.seq, run.logits));
        for (row, id) in rows.enumerate() {
            match index(&self.running, id) {
                Some(i) => {
                    let seq = &mut self.running[i];
                    step.rows
                        .push((seq.sampler.filter(), seq.sampler.device_draw()));
                    step.logprobs.push(seq.top_logprobs.is_some());
                    seq.sampler
                        .device_penalties(&seq.tokens, row, vocab, &mut step.penalties);
                }
                None => {
                    step.rows.push((Filter::GREEDY, Filter::GREEDY.draw(0)));
                    step.logprobs.push(false);
                }
            }
        }
        true
    }

    /// [`Scheduler::finish_step`] for a step whose rows the device reduced.
    pub fn finish_sampled_step(
        &mut self,
        plan: StepPlan,
        step: &mut SampledStep,
        stats: DispatchStats,
    ) -> StepCounts {
        self.finish(plan, StepLogits::Sampled(step), stats)
    }

    fn finish(
        &mut self,
        plan: StepPlan,
        mut logits: StepLogits<'_>,
        stats: DispatchStats,
    ) -> StepCounts {
        let mut counts = StepCounts::default();
        let mut row = 0;
        let mut failed = Vec::new();
        let now = Instant::now();
        let mut copies = plan.block_copies;
        for &(id, _, _) in &copies {
            if let Some(seq) = self.running.iter_mut().find(|s| s.id == id) {
                seq.kv.uncopied = 0;
            }
        }
        self.kv.drop_copies(&mut copies, |_| true);
        for run in plan.runs {
            // This run's rows of the step's logits.
            let rows = row..row + run.logits;
            row = rows.end;
            let Some(index) = self.running.iter().position(|s| s.id == run.seq) else {
                continue;
            };
            let seq = &mut self.running[index];
            let draft = std::mem::take(&mut seq.draft);
            if seq.kv.computed < seq.prompt_len {
                counts.prefill_tokens += run.tokens.min(seq.prompt_len - seq.kv.computed);
                seq.prefill_stats = seq.prefill_stats + stats;
            } else {
                seq.decode_stats = seq.decode_stats + stats;
                seq.decode_steps += 1;
            }
            // Its own tokens; the draft's as far as they are accepted.
            seq.kv.computed += run.tokens - draft.len();
            // Row k is sampled after k draft tokens: the draft goes on while it is what
            // the model samples (exactly the model's distribution, row by row).
            let mut accepted = 0;
            let mut ended = None;
            let mut sent = Vec::new();
            for (k, r) in rows.enumerate() {
                let seq = &mut self.running[index];
                let forced = match (&mut self.forced_acceptance, draft.get(k)) {
                    (Some((rate, draws)), Some(&d)) => (draws.next_f64() < *rate).then_some(d),
                    _ => None,
                };
                match accept_row(seq, &mut logits, (r, forced), (now, &mut sent), &mut counts) {
                    Ok(None) if draft.get(k).is_some_and(|&d| seq.tokens.last() == Some(&d)) => {
                        accepted += 1;
                    }
                    Ok(None) => break,
                    Ok(Some(reason)) => {
                        ended = Some(Ok(reason));
                        break;
                    }
                    Err(e) => {
                        ended = Some(Err(e));
                        break;
                    }
                }
            }
            let seq = &mut self.running[index];
            // The run's tokens go to the client in one event.
            if !sent.is_empty() && seq.events.send(Event::Tokens(sent)).is_err() && ended.is_none()
            {
                ended = Some(Ok(seq.handle.departed_reason()));
            }
            if !draft.is_empty() {
                counts.draft_tokens += draft.len();
                counts.accepted_tokens += accepted;
                counts.drafts += 1;
                seq.drafted.0 += draft.len();
                seq.drafted.1 += accepted;
                let last = counts.accepted_by_position.len() - 1;
                for k in 0..accepted {
                    counts.accepted_by_position[k.min(last)] += 1;
                }
                if self.adaptive_drafts {
                    seq.acceptance.observe(accepted, draft.len());
                }
                self.kv.settle_draft(
                    seq.id,
                    &mut seq.kv,
                    (accepted, draft.len()),
                    ended.is_none(),
                    &mut self.pending,
                );
            }
            if let Some(c) = self.kv.checkpoint(&mut seq.kv, seq.prompt_len) {
                counts.checkpoint_copies.push(c);
            }
            match ended {
                None => {}
                Some(Ok(reason)) => self.end(index, reason, now, &mut counts),
                Some(Err(e)) => failed.push((run.seq, e)),
            }
        }
        for (id, message) in failed {
            if let Some(index) = self.running.iter().position(|s| s.id == id) {
                let mut seq = self.running.remove(index);
                self.release(&mut seq);
                tracing::warn!(%message, "request failed");
                let _ = seq.events.send(Event::Failed(message));
            }
        }
        counts
    }

    /// Ends running sequence `index` for `reason`: a hybrid's state checkpointed at its last
    /// computed token, its computed blocks left in the prefix cache, its end in `counts`.
    pub(super) fn end(
        &mut self,
        index: usize,
        reason: FinishReason,
        now: Instant,
        counts: &mut StepCounts,
    ) {
        let mut seq = self.running.remove(index);
        if let Some(c) = self.kv.final_checkpoint(&mut seq.kv, seq.prompt_len) {
            counts.checkpoint_copies.push(c);
        }
        self.release(&mut seq);
        let first = seq.first_token.unwrap_or(now);
        let finished = Finished {
            reason,
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.generated(),
            cached_tokens: seq.cached,
            prompt_ms: (first - seq.arrived).as_secs_f64() * 1e3,
            decode_ms: (now - first).as_secs_f64() * 1e3,
            prefill_stats: seq.prefill_stats,
            decode_steps: seq.decode_steps,
            drafted: seq.drafted,
            decode_stats: seq.decode_stats,
            constraint: seq.constraint.as_ref().map(Constraint::stats),
        };
        counts.finished.push((seq.events, finished));
    }
}

/// Logits row `row` of a step for `seq`: its token sampled (under its grammar), or the
/// `forced` one, then, unless it is a stop id, appended and added to what is `sent` to its
/// client; `Some` reason where the sequence ends with it, `Err` where its grammar fails.
fn accept_row(
    seq: &mut Sequence,
    logits: &mut StepLogits<'_>,
    (row, forced): (usize, Option<u32>),
    (now, sent): (Instant, &mut Vec<TokenEvent>),
    counts: &mut StepCounts,
) -> Result<Option<FinishReason>, String> {
    let (token, logprob, top) = match (forced, logits) {
        (Some(token), _) => (token, None, Vec::new()),
        (None, StepLogits::Whole(logits, vocab)) => {
            let row_logits = &mut logits[row * *vocab..(row + 1) * *vocab];
            // Log-probabilities are the model's, before any penalty the sampler applies.
            let raw = seq.top_logprobs.map(|n| (row_logits.to_vec(), n));
            if let Some(constraint) = &mut seq.constraint {
                constraint.mask_logits(row_logits)?;
            }
            let token = seq.sampler.sample(row_logits, &seq.tokens);
            match raw {
                Some((raw, n)) => {
                    let (lse, top) = log_softmax_top(&raw, n);
                    (token, Some(lse_logprob(&raw, token, lse)), top)
                }
                None => (token, None, Vec::new()),
            }
        }
        (None, StepLogits::Sampled(step)) => sampled_token(seq, step, row),
    };
    let finish = if seq.stop_token_ids.contains(&token) {
        Some(FinishReason::Stop)
    } else {
        let complete = match seq.constraint.as_mut() {
            Some(c) => c.accept(token)?,
            None => false,
        };
        seq.tokens.push(token);
        counts.generated_tokens += 1;
        sent.push(TokenEvent {
            id: token,
            cached_prompt_tokens: seq.cached,
            logprob,
            top_logprobs: top,
        });
        if complete {
            Some(FinishReason::Stop)
        } else if seq.generated() >= seq.max_tokens || seq.tokens.len() >= seq.max_context {
            Some(FinishReason::Length)
        } else {
            None
        }
    };
    match seq.last_token {
        None => {
            seq.first_token = Some(now);
            counts.ttft.push((now - seq.arrived).as_secs_f64());
        }
        Some(last) => counts.inter_token.push((now - last).as_secs_f64()),
    }
    seq.last_token = Some(now);
    Ok(finish)
}

/// A step's logits as read back.
enum StepLogits<'a> {
    /// Every row whole, `[rows, vocab]`.
    Whole(&'a mut [f32], usize),
    /// Every row reduced on the device.
    Sampled(&'a mut SampledStep),
}

/// `(token, its log-probability, the top ones)` of logits row `row` of a sampled step. Rows
/// asking for log-probabilities have no penalties here ([`Sampler::needs_whole_logits`]), so
/// the candidates' logits are the model's.
fn sampled_token(
    seq: &mut Sequence,
    step: &SampledStep,
    row: usize,
) -> (u32, Option<f32>, Vec<(u32, f32)>) {
    let Some(candidates) = step.candidates.get(row) else {
        return (0, None, Vec::new());
    };
    if let Some(full) = step.full_rows.get(row).and_then(Option::as_ref) {
        let token = seq.sampler.sample_penalised(full);
        return match seq.top_logprobs {
            Some(n) => {
                let (lse, top) = log_softmax_top(full, n);
                (token, Some(lse_logprob(full, token, lse)), top)
            }
            None => (token, None, Vec::new()),
        };
    }
    let token = seq.sampler.sample_candidates(candidates).unwrap_or(0);
    let Some(n) = seq.top_logprobs else {
        return (token, None, Vec::new());
    };
    let lse = candidates.log_sum_exp;
    let logit = candidates
        .top
        .iter()
        .chain(candidates.gumbel.as_ref())
        .find(|(id, _)| *id == token)
        .map_or(f32::NEG_INFINITY, |&(_, l)| l);
    let top = candidates
        .top
        .iter()
        .take(n)
        .map(|&(id, l)| (id, l - lse))
        .collect();
    (token, Some(logit - lse), top)
}

/// `(log-sum-exp of logits, the n most likely tokens with their log-probabilities)`.
fn log_softmax_top(logits: &[f32], n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(idx.len());
    if n > 0 {
        idx.select_nth_unstable_by(n - 1, |a, b| {
            logits[*b as usize].total_cmp(&logits[*a as usize])
        });
    }
    let mut top: Vec<(u32, f32)> = idx[..n]
        .iter()
        .map(|&i| (i, logits[i as usize] - lse))
        .collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    (lse, top)
}

fn lse_logprob(logits: &[f32], token: u32, lse: f32) -> f32 {
    logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |l| l - lse)
}
