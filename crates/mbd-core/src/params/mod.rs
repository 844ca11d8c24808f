//! The params wing: every name a caller can pass. Request parameters (`request`: `PARAMS`, `GenRequest` and
//! friends), load options (`load`: `LOAD_PARAMS`, `LoadOptions`), and the decoding profile a checkpoint implies
//! with the caller's overrides (`profile`).

pub mod load;
pub mod profile;
pub mod request;
