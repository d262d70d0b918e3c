"""build_module as documented: example_inputs is a list holding exactly one tuple of tensors; the
module is module_cls(**module_init_kwargs) with the checkpoint's weights (strictly); the returned
callable takes positional tensors of the traced shapes and dtypes only (static shapes). At
tp_degree N there are N ranks, each a module loaded with its shard of the parameters NxD shards
(those with a `partition_dim`: SPMDRank's rank) and run on its own thread with the same inputs,
joined by the tensor-parallel all-reduce; the call returns rank 0's outputs, as an NxDModel does."""

import threading

import torch
from neuronx_distributed.parallel_layers.mappings import Group, joined

CALLS = []  # what was built, for the tests


def build_module(
    module_cls,
    example_inputs,
    module_init_kwargs=None,
    tp_degree=1,
    world_size=None,
    local_ranks_size=None,
    compiler_args=None,
    compiler_workdir=None,
    checkpoint_path=None,
    priority_model_idx=0,
    logical_nc_config=1,
    dry_run=False,
    checkpoint_loader_fn=torch.load,
):
    if not isinstance(example_inputs, list) or len(example_inputs) != 1 or not isinstance(example_inputs[0], tuple):
        raise TypeError("example_inputs must be a list with exactly one tuple of tensors")
    if not all(isinstance(t, torch.Tensor) for t in example_inputs[0]):
        raise TypeError("example_inputs: positional tensors only")
    if not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(f"tp_degree must be a positive int, got {tp_degree!r}")
    module_init_kwargs = {} if module_init_kwargs is None else module_init_kwargs
    if not isinstance(module_init_kwargs, dict):
        raise TypeError("module_init_kwargs must be a dict")
    state = checkpoint_loader_fn(checkpoint_path) if checkpoint_path is not None else None
    ranks = [_rank_module(module_cls, module_init_kwargs, state, rank, tp_degree) for rank in range(tp_degree)]
    signature = [(t.shape, t.dtype) for t in example_inputs[0]]
    CALLS.append(
        {
            "cls": module_cls.__name__,
            "tp_degree": tp_degree,
            "signature": signature,
            "kwargs": sorted(module_init_kwargs),
            "workdir": compiler_workdir,
        }
    )

    def traced(*args):
        if [(t.shape, t.dtype) for t in args] != signature:
            raise RuntimeError(f"a traced module takes {signature}, got {[(t.shape, t.dtype) for t in args]}")
        if tp_degree == 1:
            with torch.no_grad():
                return ranks[0](*args)
        return _run_ranks(ranks, args)

    return traced


def _rank_module(module_cls, kwargs, state, rank, tp_degree):
    module = module_cls(**kwargs)
    if state is not None:
        sharded = {n: p.partition_dim for n, p in module.named_parameters() if hasattr(p, "partition_dim")}
        own = {k: v.chunk(tp_degree, sharded[k])[rank] if k in sharded else v for k, v in state.items()}
        module.load_state_dict(own, strict=True)
    return module.eval()


def _run_ranks(ranks, args):
    group, outputs, errors = Group(len(ranks)), [None] * len(ranks), []

    def run(rank):
        joined(group, rank)
        try:
            with torch.no_grad():
                outputs[rank] = ranks[rank](*args)
        except BaseException as exc:
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:  # the failing rank's error, not the broken barrier of the others
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return outputs[0]
