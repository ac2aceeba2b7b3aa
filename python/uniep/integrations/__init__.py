"""Adapters between UniEP and model libraries: ``uniep.integrations.hf`` (Hugging Face
transformers). Each is imported on its own, so that UniEP does not depend on those libraries."""

__all__ = ["hf"]
