//! Checkpoints: model weights as (sharded) safetensors, and the whole training state.
