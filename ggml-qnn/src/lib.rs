//! The Qualcomm QNN device (dlopen'ed `libQnnHtp.so`, static-shape graph cache, scale
//! buckets, prefill-to-decode graph switching), behind the `qnn` feature.
//!
//! **Nothing is implemented here yet**; it builds on the backend plugin.
