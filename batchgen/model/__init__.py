"""Model code: loading a local Hugging Face checkpoint, the Llama-family forward over a flattened
batch, the attention backends, and the runner that feeds the engine's steps to it."""
