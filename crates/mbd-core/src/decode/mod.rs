//! The decode wing: pure policy over logits rows. The multi-block decoding state machine (`decoder`), logits rows to
//! predictions (`sampling`) after the logits controls (`penalties`), S2D2's verification routing and the speculative acceptance rule (`speculative`), I-DLM's
//! strided decoding (`strided`), CreditDecoding's credit (`credit`) and the cache policies' names (`cache_policy`). No
//! forward, no files.

pub mod cache_policy;
pub mod credit;
pub mod decoder;
pub mod grammar;
pub mod penalties;
pub mod sampling;
pub mod speculative;
pub mod strided;
