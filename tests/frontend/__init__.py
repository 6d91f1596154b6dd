"""Tests of attncc.frontend: tracing Python mods and the .attn text format."""
