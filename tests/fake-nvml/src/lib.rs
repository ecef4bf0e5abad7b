//! A fake `libnvidia-ml.so`: exports the NVML C functions muster calls, answering from a JSON
//! fixture named by `FAKE_NVML_FIXTURE`. Loaded through nvml-wrapper's real `dlopen` path via
//! `MUSTER_NVML_LIBRARY`, so CI exercises the same code as a GPU node.
//!
//! (Filled in by the GPU pre-flight work.)
