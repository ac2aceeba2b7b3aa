"""The state-dict hooks of every adapter: its checkpoints keep the library's names and layout
while the module holds UniEP's ``w1`` / ``w2``. An adapter gives ``save(module, state_dict,
prefix)``, which rewrites UniEP's keys into the library's, and ``load(module, state_dict, prefix,
error_msgs)``, the reverse; torch's hook signatures live here once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

Save = Callable[[Any, dict, str], None]
Load = Callable[[Any, dict, str, list], None]


class _SaveHook:
    """``state_dict``'s post-hook (an object at module level, not a closure: torch marks the hook
    with an attribute, and a model holding it still pickles)."""

    def __init__(self, save: Save) -> None:
        self.save = save

    def __call__(
        self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict
    ) -> None:
        self.save(module, state_dict, prefix)


class _LoadHook:
    """``load_state_dict``'s pre-hook, as ``_SaveHook``."""

    def __init__(self, load: Load) -> None:
        self.load = load

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        self.load(module, state_dict, prefix, error_msgs)


def register_layout_hooks(module: nn.Module, save: Save, load: Load) -> None:
    """``state_dict()`` gives the library's layout (``save``); ``load_state_dict`` takes it, or
    UniEP's own (``load``, which reports what it cannot convert in ``error_msgs``)."""
    module.register_state_dict_post_hook(_SaveHook(save))
    module.register_load_state_dict_pre_hook(_LoadHook(load))
