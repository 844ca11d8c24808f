//! Structured outputs: a request's grammar compiled over the model's vocabulary ([`compile`]) and kept, step by
//! step, by the decoding loop ([`constraint`]).

pub mod compile;
pub mod constraint;
