"""Count the operators a piece of code dispatches: host reads (a device synchronisation on an accelerator) and
kernel launches. Shared by the model tests (`from tests.dispatch_utils import count_dispatched_ops`)."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longrange.compat import CACHE_NAME

# torch.compile of whole models: before transformers 5.24 the cache field is `past_key_values`, and the output
# classes that bridge both names (longrange/compat.py) make dynamo break the graph at every output (README,
# Supported versions). The host-read and operator counts hold on every version.
needs_traceable_outputs = pytest.mark.skipif(
    CACHE_NAME != "cache", reason="fullgraph compile of the models needs transformers >= 5.24 (cache field name)"
)
# transformers' assisted / prompt-lookup decoding before 5.24 builds its own caches beside a model's
# (`cache_implementation` with `past_key_values`) and calls `crop` with the length to keep: supported from 5.24
needs_current_assisted_decoding = pytest.mark.skipif(
    CACHE_NAME != "cache", reason="assisted and prompt-lookup decoding of the models need transformers >= 5.24"
)

# operators that read a device value back to the host: `.item()`, `.tolist()`, `bool(t)` (`_local_scalar_dense`),
# `torch.where(cond)` / `nonzero` and the ops whose output size depends on values (`nonzero_static` has a fixed
# size and does not). Indexing with a boolean mask runs its nonzero inside the kernel, out of the mode's sight: the
# recorder counts it as BOOL_MASK_INDEX.
BOOL_MASK_INDEX = "aten.index (boolean mask)"
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.item",
        "aten.is_nonzero",
        "aten.equal",
        "aten.masked_select",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        BOOL_MASK_INDEX,
    }
)

# operators that only make a new view of existing memory (no kernel on any device)
VIEW_OPS = frozenset(
    {
        "aten.view",
        "aten._unsafe_view",
        "aten.reshape",
        "aten._reshape_alias",
        "aten.unsqueeze",
        "aten.squeeze",
        "aten.permute",
        "aten.transpose",
        "aten.t",
        "aten.expand",
        "aten.slice",
        "aten.select",
        "aten.narrow",
        "aten.detach",
        "aten.alias",
        "aten.split",
        "aten.split_with_sizes",
        "aten.chunk",
        "aten.unbind",
        "aten.as_strided",
        "aten.diagonal",
        "aten.unfold",
        "aten.lift_fresh",
        "aten.view_as_real",
        "aten.view_as_complex",
    }
)


_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)  # e.g. "aten.mm" (overloads merged)
        self.counts[name] += 1
        if name in _INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            self.counts[BOOL_MASK_INDEX] += 1
        return func(*args, **(kwargs or {}))


def count_dispatched_ops(fn: Callable[[], object]) -> collections.Counter:
    """Run `fn()` and count every aten operator it dispatches, by name ("aten.mm"), in the forward pass and, when
    `fn` calls `backward()`, in the backward pass too (the autograd engine carries the mode to its threads)."""
    recorder = _Recorder()
    with recorder:
        fn()
    return recorder.counts


def sync_ops(counts: collections.Counter) -> dict[str, int]:
    """The host-reading operators among `counts` (an empty dict when there are none)."""
    return {name: n for name, n in counts.items() if name in SYNC_OPS}


def kernel_ops(counts: collections.Counter) -> collections.Counter:
    """`counts` without the view operators (and the boolean-mask marker): about one kernel launch each on an
    accelerator."""
    return collections.Counter(
        {name: n for name, n in counts.items() if name not in VIEW_OPS and name != BOOL_MASK_INDEX}
    )


def tensor_addresses(obj, path: str = "cache", seen: set | None = None) -> dict[str, int]:
    """Every tensor reachable from `obj` through attributes, lists, tuples and dicts (modules excepted): path ->
    data address."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, torch.nn.Module):
        return {}
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {path: obj.data_ptr()}
    items = []
    if isinstance(obj, (list, tuple)):
        items = [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(f"{path}[{key!r}]", value) for key, value in obj.items()]
    elif hasattr(obj, "__dict__"):
        items = [(f"{path}.{name}", value) for name, value in vars(obj).items()]
    return {
        key: address for item_path, value in items for key, address in tensor_addresses(value, item_path, seen).items()
    }


def record_cache_addresses(model, monkeypatch) -> tuple[list[dict[str, int]], object]:
    """(records, logits processors for generate()): after the prompt's forward and after every decoding step (a
    logits processor runs outside the compiled model), where each tensor of generate()'s cache lives. A decoding
    step replayed as a CUDA graph reads and writes the addresses the graph recorded, so the cache must be allocated
    before the first step and only ever updated in place: every record should equal the first."""
    from transformers import LogitsProcessor, LogitsProcessorList

    records, generation = [], {}
    prepare = model._prepare_cache_for_generation

    def spy(generation_config, model_kwargs, *args, **kwargs):
        result = prepare(generation_config, model_kwargs, *args, **kwargs)
        generation["cache"] = model_kwargs[CACHE_NAME]
        return result

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):
            records.append(tensor_addresses(generation["cache"]))
            return scores

    monkeypatch.setattr(model, "_prepare_cache_for_generation", spy)
    return records, LogitsProcessorList([Record()])


def moved_tensors(records: list[dict[str, int]]) -> list[str]:
    """The cache tensors of `record_cache_addresses` that were replaced (or appeared) after the first record."""
    return sorted({key for record in records[1:] for key in record if record[key] != records[0].get(key)})


def recording_backend(graphs: list, backend: str = "aot_eager") -> Callable:
    """A torch.compile backend: `backend`, appending to `graphs` the example inputs of every graph it compiles.
    A CUDA graph is recorded anew for every new value of a Python number among a graph's inputs (a count that grows
    each step makes dynamo recompile first, then re-record at every step): a decoding step should take tensors only."""
    from torch._dynamo.backends.registry import lookup_backend

    def compile_graph(gm, example_inputs, **options):  # options: CompileConfig's mode, for CUDA graphs only
        graphs.append(list(example_inputs))
        return lookup_backend(backend)(gm, example_inputs)

    return compile_graph


def number_inputs(graphs: list) -> list[str]:
    """The inputs of `recording_backend`'s graphs that are not tensors (symbolic or plain Python numbers)."""
    return [repr(value) for inputs in graphs for value in inputs if not isinstance(value, torch.Tensor)]
