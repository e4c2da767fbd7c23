//! `--speculative`: which drafter proposes the tokens each decoding step verifies, and how
//! many at most.

use std::str::FromStr;

use anyhow::{Context, Result, bail};
use corral_engine::{CombinedDrafter, Drafter, LookupDrafter, MtpDrafter, Speculation};
use corral_model::Model;

use crate::loading::{ModelArgs, SYNTHETIC_SEED};

/// Draft tokens a step verifies when `--speculative` names no K.
const DEFAULT_MTP_TOKENS: usize = 3;
const DEFAULT_LOOKUP_TOKENS: usize = 4;
/// The most a step verifies.
const MAX_DRAFT_TOKENS: usize = 8;

/// How decoding speculates: `off`, `mtp[:K]` (the checkpoint's MTP head), `lookup[:K]`
/// (prompt lookup), `mtp+lookup[:K]` (lookup where it matches, else the head), or `auto`;
/// `:fixed` after K keeps every draft K long, and `:replay` rolls a hybrid's rejected draft
/// back by a snapshot and computing the accepted tokens again (for measuring the default,
/// its state kept after each draft position).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Speculative {
    Off,
    Mtp(Drafts),
    Lookup(Drafts),
    MtpLookup(Drafts),
    /// `mtp+lookup` where the checkpoint has an MTP head, else `lookup`, while at most
    /// [`AUTO_MAX_RUNNING`] sequences run.
    Auto,
}

/// A drafter's draft lengths: at most `max` tokens; each sequence's length adapts to its
/// acceptance unless `fixed`. `replay`: a hybrid rolls rejected drafts back by computing
/// the accepted tokens again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Drafts {
    pub(crate) max: usize,
    pub(crate) fixed: bool,
    pub(crate) replay: bool,
}

impl Drafts {
    fn adaptive(max: usize) -> Self {
        Self {
            max,
            fixed: false,
            replay: false,
        }
    }
}

impl std::fmt::Display for Drafts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{}{}",
            self.max,
            if self.fixed { ":fixed" } else { "" },
            if self.replay { ":replay" } else { "" }
        )
    }
}

impl FromStr for Speculative {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(':');
        let kind = parts.next().unwrap_or_default();
        let k = match parts.next() {
            Some(k) => {
                let k: usize = k
                    .parse()
                    .map_err(|_| format!("draft tokens `{k}` is not a number"))?;
                if !(1..=MAX_DRAFT_TOKENS).contains(&k) {
                    return Err(format!(
                        "draft tokens must be 1 to {MAX_DRAFT_TOKENS}, not {k}"
                    ));
                }
                Some(k)
            }
            None => None,
        };
        let (mut fixed, mut replay) = (false, false);
        for part in parts {
            match part {
                "fixed" if !fixed && !replay => fixed = true,
                "replay" if !replay => replay = true,
                _ => {
                    return Err(format!(
                        "`{s}`: only `:fixed`, then `:replay`, may follow K"
                    ));
                }
            }
        }
        let drafts = |default: usize| Drafts {
            max: k.unwrap_or(default),
            fixed,
            replay,
        };
        match (kind, k) {
            ("off", None) => Ok(Self::Off),
            ("auto", None) => Ok(Self::Auto),
            ("mtp", _) => Ok(Self::Mtp(drafts(DEFAULT_MTP_TOKENS))),
            ("lookup", _) => Ok(Self::Lookup(drafts(DEFAULT_LOOKUP_TOKENS))),
            ("mtp+lookup", _) => Ok(Self::MtpLookup(drafts(DEFAULT_MTP_TOKENS))),
            _ => Err(format!(
                "`{s}` is not off, auto, mtp[:K], lookup[:K] or mtp+lookup[:K] (K draft tokens a step, 1 to {MAX_DRAFT_TOKENS}, then `:fixed` to keep every draft K long, `:replay` to roll a hybrid back by computing again)"
            )),
        }
    }
}

impl std::fmt::Display for Speculative {
    /// The form `--speculative` reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Off => write!(f, "off"),
            Self::Auto => write!(f, "auto"),
            Self::Mtp(k) => write!(f, "mtp:{k}"),
            Self::Lookup(k) => write!(f, "lookup:{k}"),
            Self::MtpLookup(k) => write!(f, "mtp+lookup:{k}"),
        }
    }
}

/// Running sequences up to which `auto` drafts. On the CPU, the demo model served with
/// `mtp+lookup:3` gave 1.05–1.13× the tokens a second of plain decoding at one sequence and
/// 0.78–0.98× from two to eight; on an H100, 1.23× at one and 0.83× at eight, and the
/// 35B-A3B at a forced acceptance of 0.8 1.44× at one, where a verify step of 2 tokens a
/// sequence already costs 1.8× a one-token step at eight (docs/performance-log.md): a
/// step's own rows already fill the work that verifying drafts adds.
const AUTO_MAX_RUNNING: usize = 1;

/// Speculation for the engine, and what it is in words.
pub(crate) type EngineDrafter = (Speculation, String);

impl Speculative {
    /// Whether `self` drafts with an MTP head where one exists. For a plan made without
    /// loading the model.
    pub(crate) fn wants_head(self) -> bool {
        match self {
            Self::Mtp(_) | Self::MtpLookup(_) | Self::Auto => true,
            Self::Off | Self::Lookup(_) => false,
        }
    }

    /// The draft lengths and running limit `self` drafts with (`head`: an MTP head drafts);
    /// `None` where it does not speculate. What the engine runs and what memory plans count.
    fn lengths(self, head: bool) -> Option<(Drafts, usize)> {
        match self {
            Self::Off => None,
            Self::Auto if head => Some((Drafts::adaptive(DEFAULT_MTP_TOKENS), AUTO_MAX_RUNNING)),
            Self::Auto => Some((Drafts::adaptive(DEFAULT_LOOKUP_TOKENS), AUTO_MAX_RUNNING)),
            Self::Mtp(k) | Self::Lookup(k) | Self::MtpLookup(k) => Some((k, usize::MAX)),
        }
    }

    /// The recurrent states an engine of `max_batch` sequences keeps after each draft
    /// position for `self` beside a `hybrid` model (`head`: an MTP head drafts), for its
    /// memory plan: none where it does not speculate, replays, or the model keeps no state.
    pub(crate) fn kept_state_slots(self, (hybrid, head): (bool, bool), max_batch: usize) -> usize {
        match self.lengths(head) {
            Some((drafts, running)) if hybrid && !drafts.replay => {
                corral_engine::kept_state_groups(max_batch.max(1), running) * drafts.max
            }
            _ => 0,
        }
    }

    /// The MTP head `self` drafts with, loaded from `args`' checkpoint onto `model`'s backend:
    /// `None` where it drafts without one (`auto` where the checkpoint has none).
    pub(crate) fn head(self, args: &ModelArgs, model: &Model) -> Result<Option<Model>> {
        if !self.wants_head() {
            return Ok(None);
        }
        match self {
            // A synthetic model's random head would only slow it down.
            Self::Auto if args.dir().is_none() => Ok(None),
            Self::Auto => Ok(load_head(args, model)
                .inspect_err(|e| {
                    tracing::debug!(error = %format!("{e:#}"), "no MTP head: prompt lookup drafts");
                })
                .ok()),
            _ => load_head(args, model).map(Some),
        }
    }

    /// The drafter `self` asks for, with `head` ([`Speculative::head`]) and its KV cache of
    /// `kv_blocks` blocks of `block_size` tokens for `sequences` sequences; `None` where it
    /// does not speculate.
    pub(crate) fn drafter(
        self,
        head: Option<Model>,
        caches: (usize, usize, usize),
    ) -> Result<Option<EngineDrafter>> {
        let (kv_blocks, block_size, sequences) = caches;
        let Some((k, running)) = self.lengths(head.is_some()) else {
            return Ok(None);
        };
        let lookup = || Box::new(LookupDrafter::default());
        let (drafter, what): (Box<dyn Drafter>, &str) = match (self, head) {
            (Self::Lookup(_), _) | (Self::Auto, None) => (lookup(), "prompt lookup"),
            (Self::Mtp(_), Some(head)) => (
                Box::new(MtpDrafter::new(head, kv_blocks, block_size, sequences)?),
                "MTP head",
            ),
            (Self::MtpLookup(_) | Self::Auto, Some(head)) => (Self::both(head, caches)?, BOTH),
            (Self::Off, _) | (Self::Mtp(_) | Self::MtpLookup(_), None) => {
                bail!("--speculative {self} needs the checkpoint's MTP head")
            }
        };
        let mut speculation = Speculation::new(drafter, k.max).up_to_running(running);
        if k.fixed {
            speculation = speculation.fixed();
        }
        if k.replay {
            speculation = speculation.replaying();
        }
        let limit = match speculation.max_running {
            usize::MAX => String::new(),
            n => format!(
                ", while at most {n} sequence{} run",
                if n == 1 { "" } else { "s" }
            ),
        };
        Ok(Some((
            speculation,
            format!(
                "{what}, {} {} draft tokens{limit}",
                if k.fixed { "always" } else { "up to" },
                k.max
            ),
        )))
    }

    /// Prompt lookup, else `head` (with its caches as [`Speculative::drafter`] takes them).
    fn both(
        head: Model,
        (kv_blocks, block_size, sequences): (usize, usize, usize),
    ) -> Result<Box<dyn Drafter>> {
        let mtp = MtpDrafter::new(head, kv_blocks, block_size, sequences)?;
        Ok(Box::new(CombinedDrafter::new(
            LookupDrafter::default(),
            mtp,
        )))
    }
}

/// What [`CombinedDrafter`] is, in words.
const BOTH: &str = "prompt lookup, else the MTP head";

/// The MTP head of `args`' checkpoint (a directory's `mtp.*` tensors, or a GGUF file's
/// head blocks) on `model`'s backend; for a synthetic model, a random head of its shape. A
/// float LM head is stored again as Q8_0 for drafting ([`Model::use_q8_0_lm_head`]): each
/// draft token reads it whole, and a draft only proposes.
fn load_head(args: &ModelArgs, model: &Model) -> Result<Model> {
    let backend = model.backend().clone();
    let mut head = match args.dir() {
        None => Model::synthetic_mtp(
            model.config(),
            args.synthetic_weights,
            backend,
            SYNTHETIC_SEED,
        )
        .context("making a synthetic MTP head")?,
        Some(path) => match args.gguf()? {
            Some(gguf) => Model::mtp_from_gguf(gguf, backend, &mut |_, _| {}),
            None => Model::load_mtp(path, backend, &mut |_, _| {}),
        }
        .with_context(|| format!("loading the MTP head of {}", path.display()))?,
    };
    if head
        .use_q8_0_lm_head()
        .context("storing the MTP head's LM head as Q8_0")?
    {
        tracing::info!("the MTP head drafts with its LM head in Q8_0");
    }
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_form_and_names_what_is_wrong() {
        assert_eq!("off".parse(), Ok(Speculative::Off));
        assert_eq!("auto".parse(), Ok(Speculative::Auto));
        let up_to = Drafts::adaptive;
        assert_eq!("mtp".parse(), Ok(Speculative::Mtp(up_to(3))));
        assert_eq!("mtp:2".parse(), Ok(Speculative::Mtp(up_to(2))));
        assert_eq!("lookup".parse(), Ok(Speculative::Lookup(up_to(4))));
        assert_eq!("lookup:8".parse(), Ok(Speculative::Lookup(up_to(8))));
        assert_eq!("mtp+lookup:2".parse(), Ok(Speculative::MtpLookup(up_to(2))));
        let fixed = Drafts {
            max: 3,
            fixed: true,
            replay: false,
        };
        assert_eq!("mtp:3:fixed".parse(), Ok(Speculative::Mtp(fixed)));
        let replay = Drafts {
            replay: true,
            ..fixed
        };
        assert_eq!("mtp:3:fixed:replay".parse(), Ok(Speculative::Mtp(replay)));
        for s in [
            "off",
            "auto",
            "mtp:2",
            "lookup:8",
            "mtp+lookup:4",
            "lookup:2:fixed",
            "mtp:3:replay",
            "mtp:4:fixed:replay",
        ] {
            assert_eq!(
                s.parse::<Speculative>().map(|v| v.to_string()),
                Ok(s.to_string())
            );
        }
        for (bad, says) in [
            ("mtp:0", "1 to 8"),
            ("mtp:9", "1 to 8"),
            ("mtp:x", "not a number"),
            ("eagle", "is not off"),
            ("off:2", "is not off"),
            ("mtp:2:loose", "only `:fixed`"),
            ("mtp:2:fixed:x", "only `:fixed`"),
            ("mtp:2:replay:fixed", "only `:fixed`"),
            ("mtp:2:replay:replay", "only `:fixed`"),
        ] {
            let err = bad.parse::<Speculative>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
