"""Integrations with other libraries. Each lives in its own module and imports its library only
when used, so `import attncc.integrations` needs nothing beyond attncc itself.

- `attncc.integrations.transformers`: an "attncc" attention implementation for Hugging Face
  transformers (`register()`; needs `pip install attncc[hf]`; docs/integrations.md).
"""
