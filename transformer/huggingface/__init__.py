"""Hugging Face checkpoints in and out: `families` (config and tensor mappings of Llama,
Mistral, Qwen2, GPT-2 and ViT) and `convert` (checkpoint directory <-> workdir). The CLI is
`python -m transformer.convert`."""
