"""Test helpers: tiny deterministic models and tokenizers built offline."""
