"""Adapters between UniEP and model libraries: ``uniep.integrations.hf`` (Hugging Face
transformers) and ``uniep.integrations.megatron`` (Megatron-core-style MoE blocks, recognised by
their structure; Megatron-core itself is not imported). Each is imported on its own, so that
UniEP does not depend on those libraries."""

__all__ = ["hf", "megatron"]
