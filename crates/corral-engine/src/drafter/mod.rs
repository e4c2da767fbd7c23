//! Drafters: what proposes the tokens a decoding sequence's step verifies. The model's own
//! MTP head ([`MtpDrafter`]), its prompt and output looked up for the text that followed the
//! same words before ([`LookupDrafter`]), both at once ([`CombinedDrafter`]), or a second,
//! smaller model ([`ModelDrafter`]).

mod combined;
mod lookup;
mod model;
mod mtp;

pub use combined::CombinedDrafter;
pub use lookup::LookupDrafter;
pub use model::ModelDrafter;
pub use mtp::MtpDrafter;
