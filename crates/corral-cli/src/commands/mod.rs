//! One module per subcommand.

pub(crate) mod bench;
pub(crate) mod eval;
pub(crate) mod inspect;
pub(crate) mod logits;
pub(crate) mod plan;
pub(crate) mod run;
pub(crate) mod serve;
pub(crate) mod serve_plan;
