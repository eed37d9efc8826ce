"""Context parallelism: the ranks of a context-parallel group each hold a contiguous shard of every sequence, from
the embedding to the loss, so that a sequence too long for one device's activations trains unchanged.

Attention is the one place a token needs the others: `all_to_all` (DeepSpeed's Ulysses) exchanges the query, key
and value of the shard for those of the whole sequence and a share of the heads (heads / cp per rank), runs the
model's own attention (`F.scaled_dot_product_attention`, causal as the model asks) on them, and exchanges the output
back. It needs only all-to-all, which every backend has (gloo too). `ring` is torch's ring attention
(`RingContextParallel`): each rank keeps its heads and passes key/value shards round the group; it has rules for
CUDA's SDPA kernels only (`_scaled_dot_product_flash_attention_for_cpu` has none in torch's context-parallel API,
torch 2.13, checked), so it is refused on CPU. Its shards are torch's causal load-balanced ones (rank r holds
chunks r and 2 x cp - 1 - r of 2 x cp), the positions to match.

Without user code:
- the strategy gives the step its shard of the batch: every tensor with the sequence's length in dimension 1
  (tokens, targets, masks);
- the model's positions follow the shard: its position embedding (an `nn.Embedding` named `position_embedding`,
  `wpe` or `embed_positions`) or its rotary table (a `...RotaryEmbedding` module) is called with the shard's
  positions, shifted by the tokens before it;
- every call of `F.scaled_dot_product_attention` is exchanged around, whatever the model's code names it (a function
  mode sees it in forward; in backward, where checkpointed blocks run again, the module attribute is swapped). Each
  forward counts its exchanges: fewer than the model's blocks (attention written out, another kernel) stops the run
  in one line, as does an aliased call that checkpointing would recompute unexchanged;
- what the step logs is averaged over the group: each rank's loss is its shard's mean, and the group's mean is the
  whole sequence's (the shards hold equally many tokens);
- a transformers causal LM called with `labels=` (its loss shifts them by a token) is given the labels of the tokens
  after its shard's, which the next shard holds, and the group's count of them: each rank's loss is then its share
  of the whole sequence's, scaled so that the group's mean is that loss, exactly (the shard alone would lose the
  prediction across each boundary, and weigh shards with fewer labels more). A forward that took `labels=` and did
  not reach this loss stops in one line, as does another loss type.
  A step that shifts its targets itself (`logits[:, :-1]` against `tokens[:, 1:]`) loses the boundary's prediction:
  put the targets in the batch, shifted (the bundled data does), or pass `labels=`.
FSDP shards the weights over data x context ranks (`data_parallel_shard_cp`) and averages the gradients over them:
the average over a sequence's shards of their losses' gradients is the whole sequence's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

STYLES = ("all_to_all", "ring")
POSITION_EMBEDDINGS = ("position_embedding", "wpe", "embed_positions")


def check_context_parallel(cp: int, style: str, heads: int | None = None, sequence: int | None = None,
                           device_type: str | None = None, tensor_parallel: int = 1, world: int | None = None) -> None:
    """ValueError in one line naming the key, for a context-parallel layout that cannot run (no torch here). Under
    tensor parallelism each rank holds heads / tp of them, which all_to_all splits again by cp. `world`: the ranks
    the groups divide (DeepSpeed's Ulysses: every rank), checked here where given; each size suggested passes every
    check made here."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"strategy.context_parallel_size={cp!r}: give a whole number of ranks, at least 1")
    if cp == 1:
        return
    if style not in STYLES:
        raise ValueError(f"strategy.context_parallel={style!r}: choose one of {', '.join(STYLES)}")
    if style == "ring" and device_type == "cpu":
        raise ValueError("strategy.context_parallel=ring: not available on CPU: torch's SDPA for CPU has no rule in"
                         " its context-parallel API; choose all_to_all (Ulysses), which runs everywhere")
    if world is not None and world % cp:
        raise ValueError(f"strategy.context_parallel_size={cp}: the {world} ranks do not divide into sequence-parallel"
                         f" groups of that size; choose one of {_choices(world, style, heads, tensor_parallel)}")
    if style == "all_to_all" and heads is not None and heads % (cp * tensor_parallel) and world is not None:
        raise ValueError(f"strategy.context_parallel_size={cp}: all_to_all gives each rank {heads}/{cp} of the"
                         f" model's {heads} attention heads (model.n_head); choose one of"
                         f" {_choices(world, style, heads, tensor_parallel)}")
    if style == "all_to_all" and heads is not None and heads % (cp * tensor_parallel):
        share, choice = (f"{heads}/{cp}", "a size that") if tensor_parallel == 1 else \
            (f"{heads}/({tensor_parallel} x {cp})", "tensor- and context-parallel sizes whose product")
        raise ValueError(f"strategy.context_parallel_size={cp}: all_to_all gives each rank {share} of the model's"
                         f" {heads} attention heads (model.n_head); choose {choice} divides {heads}")
    if sequence is not None and sequence % (2 * cp):
        raise ValueError(f"strategy.context_parallel_size={cp}: a sequence of {sequence} tokens (data.block_size)"
                         f" does not split into 2 x {cp} equal chunks; choose a size or a length that does")


def _choices(world: int, style: str, heads: int | None, tensor_parallel: int) -> str:
    """The sizes that divide `world` and, under all_to_all, the heads."""
    return ", ".join(str(n) for n in range(1, world + 1) if world % n == 0 and (
        style != "all_to_all" or heads is None or heads % (n * tensor_parallel) == 0))


def model_unsplit(facts: Any, cp: int) -> str | None:
    """Why a model's sequences cannot be split over `cp` ranks, read from its facts (memory/model_facts.py: the
    attention calls its trace saw, whether it has positions to shift), or None."""
    if facts.attention is None:
        return "the model makes no F.scaled_dot_product_attention call for context parallelism to exchange"
    if not facts.positions:
        return "the model has no position embedding or rotary table for a shard's positions"
    queries, keys, tokens = facts.attention
    if queries % cp or keys % cp:
        return f"its attention's {queries} query and {keys} key/value heads do not divide by {cp}"
    if tokens % (2 * cp):
        return f"its {tokens}-token sequences do not split into {2 * cp} chunks"
    return None


def activations_held(activations: float, cp: int, layout: Any) -> float:
    """What one of `cp` ranks saves of a step's `activations` (the memory planner's): its shard of every sequence
    (attention's whole-sequence query, key and value for its heads are transient)."""
    return activations / cp


def position_modules(model: Any) -> dict[str, Any]:
    """The modules that give `model` its positions, by name: its position embeddings (`POSITION_EMBEDDINGS`) and
    rotary tables (a `...RotaryEmbedding`)."""
    from torch import nn

    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Embedding) and name.rpartition(".")[2] in POSITION_EMBEDDINGS
            or type(module).__name__.endswith("RotaryEmbedding")}


def context_refusal(model: Any, cp: int) -> str | None:
    """Why the sequences of `model` cannot be split over `cp` ranks, in one line (its shards cannot be given their
    positions; its attention is not scaled_dot_product_attention, which the exchange goes around), or None when they
    can. What its forward really calls is counted at every step (`ContextParallel.counted_forward`)."""
    return positions_refusal(model, cp) or attention_refusal(model, cp)


def attention_refusal(model: Any, cp: int) -> str | None:
    """A transformers model in `model` set to attend otherwise than by SDPA (eager, a flash or flex kernel), or
    whose class has no SDPA attention (GPT-OSS's sinks), in one line; None otherwise."""
    from lightning_dist._compat.transformers import attention_in_use, transformers_models

    said = f"strategy.context_parallel_size={cp}"
    for transformers_model in transformers_models(model)[:1]:  # the outermost: its base model shares its config
        implementation, has_sdpa = attention_in_use(transformers_model)
        name = type(transformers_model).__name__
        if not has_sdpa:
            return (f"{said}: {name} has no scaled_dot_product_attention implementation in transformers (it runs"
                    f" {implementation} attention), and context parallelism exchanges that function's inputs across"
                    " the ranks; train it without context parallelism")
        if implementation not in (None, "sdpa"):
            return (f"{said}: {name} attends with attn_implementation=\"{implementation}\"; context parallelism"
                    " exchanges scaled_dot_product_attention's inputs across the ranks: load it with"
                    " attn_implementation=\"sdpa\"")
    return None


def positions_refusal(model: Any, cp: int) -> str | None:
    """Why the shards of `model` cannot be given their positions, in one line (a model without a position module
    found by name, or one whose module takes them in no argument we know); None when they can."""
    said, model_name = f"strategy.context_parallel_size={cp}", user_class_name(model)
    if not (found := position_modules(model)):
        return (f"{said}: {model_name} has no position embedding ({', '.join(POSITION_EMBEDDINGS)}) or rotary table"
                " to give each shard its positions (ALiBi models, such as BLOOM, have none)")
    if unknown := [name for name, module in found.items() if positions_argument(module) is None]:
        return (f"{said}: {unknown[0]} ({type(found[unknown[0]]).__name__}) takes no argument named position_ids or"
                " input, so this shard's positions cannot be given to it")
    return None


def user_class_name(model: Any) -> str:
    """The name of `model`'s class, or, sharded, of the class FSDP2 made its own subclass of (FSDP<name>): the first
    that is not torch's."""
    return next(kind for kind in type(model).__mro__ if not kind.__module__.startswith("torch.")).__name__


def positions_argument(module: Any) -> tuple[str, int] | None:
    """The argument of `module`'s forward that carries the positions, by name and place: `position_ids` where the
    forward takes one (a rotary table's; OPT's learned embedding's, whose first argument is the attention mask), else
    an `nn.Embedding`'s own `input`; None where it takes neither."""
    import inspect

    parameters = list(inspect.signature(module.forward).parameters)
    return next(((name, parameters.index(name)) for name in ("position_ids", "input") if name in parameters), None)


# How the attention of a shard sees the whole sequence: (query, key, value, attend) -> output, each (B, H, T/cp, D);
# `attend` is the model's own attention call on the exchanged tensors.
Exchange = Callable[[Any, Any, Any, Callable[[Any, Any, Any], Any]], Any]


class ContextParallel:
    """One rank's part of a context-parallel group (`group`, this rank's `rank` of `size`; `device`: where its
    collectives' tensors are). `exchange`: how attention sees the whole sequence; unset, torch's all-to-all
    (`all_to_all_attention`)."""

    def __init__(self, group: Any, rank: int, size: int, device: Any = "cpu", exchange: Exchange | None = None) -> None:
        self.group, self.rank, self.size, self.device = group, rank, size, device
        self.exchange: Exchange = exchange or (
            lambda query, key, value, attend: all_to_all_attention(query, key, value, attend, group, size))

    def shard(self, batch: Any) -> Any:
        """This rank's contiguous shard of every sequence in `batch` (tensors of two or more dimensions, split
        along dimension 1)."""
        import torch

        from lightning_dist._compat.torch import tree_map

        def cut(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                return value
            if value.shape[1] % self.size:
                raise ValueError(f"strategy.context_parallel_size={self.size}: a batch of sequences of"
                                 f" {value.shape[1]} tokens does not split into {self.size} equal shards")
            return value.tensor_split(self.size, dim=1)[self.rank]

        return tree_map(cut, batch)

    @contextmanager
    def step(self, module: Any) -> Iterator[None]:
        """A step of `module` on this rank's shard: its positions shifted, its attention exchanged across the
        group, what it logs averaged over the group."""
        with ExitStack() as stack:
            stack.enter_context(self.positions_shifted(module))
            stack.enter_context(self.sequence_losses(module))
            stack.enter_context(self.counted_forward())
            stack.enter_context(self.attention())
            stack.enter_context(self.logs_averaged(module))
            yield

    # Set by the strategy once the model is known (`expect_exchanges`): its attention layers (one per block), and
    # whether checkpointed blocks run their forward again in backward.
    attention_layers: int = 0
    recomputes: bool = False
    model_name: str = "the model"

    def expect_exchanges(self, model: Any, block_classes: tuple[type, ...], recomputes: bool) -> None:
        """What each step's attention exchanges are checked against: one per block of `model` (instances of
        `block_classes`: each decoder block attends once), and whether checkpointed blocks recompute them in
        backward (`recomputes`)."""
        self.attention_layers = (sum(isinstance(module, block_classes) for module in model.modules())
                                 if block_classes else 0)
        self.recomputes = recomputes
        self.model_name = user_class_name(model)

    # The axis's part in each step (strategies/axis_steps.py).
    def run_step(self, strategy: Any, kind: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        shard = self.shard(args[0])  # first: the shard's length is what ring attention is set up for
        with self.step(strategy.lightning_module):
            return run(shard, *args[1:], **kwargs)

    def run_backward(self, strategy: Any, closure_loss: Any, run: Callable[[], Any]) -> Any:
        with self.attention():  # checkpointed blocks run their attention again in backward
            return run()

    @contextmanager
    def attention(self) -> Iterator[None]:
        """Every call of `F.scaled_dot_product_attention` exchanged across the group (all_to_all): in forward
        however the model names it (a function mode sees the call itself), and in the recomputation of checkpointed
        blocks in backward, where no function mode reaches, by that module attribute. Counted: `exchanges`."""
        from lightning_dist._compat.torch import attention_function_replaced
        from lightning_dist.parallel.every_call import every_call

        with attention_function_replaced(self._by_name) as original, every_call(original, self._aliased):
            self._original, self._inside = original, False
            yield

    @contextmanager
    def counted_forward(self) -> Iterator[None]:
        """A step's forward: afterwards, one line where its attention was not all exchanged (each shard would have
        attended to itself only: losses silently wrong)."""
        self.exchanges = {"by name": 0, "aliased": 0}
        yield
        exchanged = sum(self.exchanges.values())
        if exchanged < self.attention_layers:
            raise ValueError(
                f"strategy.context_parallel_size={self.size}: {self.model_name}'s forward called"
                f" torch.nn.functional.scaled_dot_product_attention {exchanged} times for its {self.attention_layers}"
                " blocks, so the rest of its attention (written out, or another kernel) saw only this rank's shard"
                " of the sequence; make every attention layer call scaled_dot_product_attention (transformers:"
                " attn_implementation=\"sdpa\")")
        if self.exchanges["aliased"] and self.recomputes:
            raise ValueError(
                f"strategy.context_parallel_size={self.size}: {self.model_name} calls scaled_dot_product_attention"
                " under another name, which is exchanged in forward but not when activation checkpointing runs the"
                " blocks again in backward; call it as torch.nn.functional.scaled_dot_product_attention, or turn"
                " strategy.activation_checkpointing off")

    def _by_name(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted("by name", args, kwargs)

    def _aliased(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted("aliased", args, kwargs)

    def _counted(self, how: str, args: tuple, kwargs: dict) -> Any:
        if self._inside:  # the exchange's own call of the original, on the exchanged tensors
            return self._original(*args, **kwargs)
        self._inside = True
        try:
            output = self._exchanged(*args, **kwargs)
        finally:
            self._inside = False
        if hasattr(self, "exchanges"):
            self.exchanges[how] += 1
        return output

    @contextmanager
    def positions_shifted(self, module: Any) -> Iterator[None]:
        """`module`'s position embedding or rotary table called with this shard's positions."""
        if refusal := positions_refusal(module, self.size):
            raise ValueError(refusal)
        found = position_modules(module)
        calls = dict.fromkeys(found, 0)
        shifts = {name: self._shifted(positional, name, calls) for name, positional in found.items()}
        handles = [found[name].register_forward_pre_hook(shift, with_kwargs=True) for name, shift in shifts.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        # Found by name, shifted where called: a step whose attention ran but whose positions never went through
        # those modules (computed inline, or by another module) gave every shard the first shard's positions.
        uncalled = [name for name, count in calls.items() if not count]
        if uncalled and sum(getattr(self, "exchanges", {}).values()):
            raise ValueError(f"strategy.context_parallel_size={self.size}: {type(module).__name__}'s forward never"
                             f" called {uncalled[0]}, the position module it was found to have, so this shard's"
                             " positions were those of the sequence's start; compute the positions by calling that"
                             " module (an nn.Embedding named position_embedding, wpe or embed_positions, or a"
                             " ...RotaryEmbedding given position_ids)")

    @contextmanager
    def logs_averaged(self, module: Any) -> Iterator[None]:
        """Each tensor `module` logs, averaged over the group (a torchmetrics object is synced as usual)."""
        import torch
        import torch.distributed as dist

        log = module.log

        def averaged(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(value, (torch.Tensor, float, int)) and not isinstance(value, bool):
                total = torch.as_tensor(value, device=self.device).detach().clone().float()
                dist.all_reduce(total, group=self.group)  # gloo has no AVG
                value = total / self.size
            return log(name, value, *args, **kwargs)

        module.log = averaged
        try:
            yield
        finally:
            del module.log

    def held_positions(self, positions: Any) -> Any:
        """The positions in the whole sequence of the shard's local `positions` (0 to its length): contiguous, after
        the shards of the ranks before this one."""
        return positions + self.rank * positions.shape[-1]

    @contextmanager
    def sequence_losses(self, module: Any) -> Iterator[None]:
        """The causal-LM losses of `module`'s transformers models (those `labels=` reaches) as shares of the whole
        sequence's (the module docstring); a forward given `labels=` that computed no such loss stops the run."""
        from lightning_dist._compat.transformers import loss_function_replaced, transformers_models

        with ExitStack() as stack:
            for model in transformers_models(module):
                stack.enter_context(loss_function_replaced(model, self._whole_sequence_loss))
                stack.callback(model.register_forward_pre_hook(self._expect_loss, with_kwargs=True).remove)
                stack.callback(model.register_forward_hook(self._check_loss, with_kwargs=True).remove)
            yield

    def _whole_sequence_loss(self, own: Callable[..., Any], loss_type: str) -> Callable[..., Any]:
        import torch
        import torch.distributed as dist

        from lightning_dist._compat.transformers import CAUSAL_LM

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise ValueError(f"strategy.context_parallel_size={self.size}: {self.model_name}'s loss from labels="
                             f" ({loss_type}) would be over this rank's shard of each sequence only; compute the loss"
                             " in the step from the model's logits, with the targets in the batch")

        def loss(logits: Any, labels: Any, vocab_size: int, num_items_in_batch: Any = None, ignore_index: int = -100,
                 shift_labels: Any = None, **kwargs: Any) -> Any:
            if num_items_in_batch is not None:
                raise ValueError(f"strategy.context_parallel_size={self.size}: leave num_items_in_batch out of the"
                                 " model's call; the labels of a sequence's shards are counted over the group")
            if shift_labels is None:  # the labels of this shard's tokens' next tokens
                shift_labels = self.next_labels(labels, ignore_index)
            counted = (shift_labels != ignore_index).sum().to(torch.float32)
            dist.all_reduce(counted, group=self.group)
            self._losses += 1
            # Summed over the shard and divided by the group's count / cp: the mean over the group's ranks (their
            # gradients' average, the logged value's) is the whole sequence's mean.
            return own(logits, labels, vocab_size, num_items_in_batch=counted / self.size, ignore_index=ignore_index,
                       shift_labels=shift_labels, **kwargs)

        return loss if loss_type == CAUSAL_LM else refused

    def next_labels(self, labels: Any, ignore_index: int) -> Any:
        """For each token of this shard, the label of the token after it in the whole sequence (`ignore_index` after
        the last): every rank's labels set at their positions in the sequence, then read one position on."""
        import torch
        import torch.distributed as dist

        held = self.held_positions(torch.arange(labels.shape[-1], device=labels.device))
        shards = [torch.empty_like(labels) for _ in range(self.size)]
        positions = [torch.empty_like(held) for _ in range(self.size)]
        dist.all_gather(shards, labels.contiguous(), group=self.group)
        dist.all_gather(positions, held, group=self.group)
        whole = labels.new_full((*labels.shape[:-1], labels.shape[-1] * self.size + 1), ignore_index)
        for shard, at in zip(shards, positions):
            whole[..., at] = shard
        return whole[..., held + 1]

    # The whole-sequence losses computed, and how many there were as each model given `labels=` started its forward
    # (by the model's id), for `_check_loss`.
    _losses = 0
    _losses_before: dict[int, int] = {}

    def _expect_loss(self, model: Any, args: tuple, kwargs: dict) -> None:
        if kwargs.get("labels") is not None:
            self._losses_before = {**self._losses_before, id(model): self._losses}

    def _check_loss(self, model: Any, args: tuple, kwargs: dict, output: Any) -> None:
        before = self._losses_before.get(id(model))
        self._losses_before = {key: value for key, value in self._losses_before.items() if key != id(model)}
        if before is not None and self._losses == before:
            raise ValueError(f"strategy.context_parallel_size={self.size}: {type(model).__name__} was called with"
                             " labels= but computed its loss without its loss_function, so the loss would be over"
                             " this rank's shard only; compute the loss in the step from the logits, with the"
                             " targets in the batch")

    def _shifted(self, module: Any, name: str, calls: dict[str, int]) -> Callable[..., Any]:
        """A pre-hook that calls `module` (the position module `name`) with this shard's positions."""
        argument, place = positions_argument(module) or ("input", 0)  # (positions_refusal refused the others)

        def shift(_: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            calls[name] += 1
            if kwargs.get(argument) is not None:
                return args, {**kwargs, argument: self.held_positions(kwargs[argument])}
            if len(args) > place and args[place] is not None:
                return (*args[:place], self.held_positions(args[place]), *args[place + 1:]), kwargs
            # It would count the positions itself, from the start of the sequence (OPT's from its attention mask)
            raise ValueError(f"strategy.context_parallel_size={self.size}: {name} was called without its {argument},"
                             " so it would count this shard's positions from the sequence's start; pass them")

        return shift

    def _exchanged(self, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
        """The model's attention call on this shard: the whole sequence's for a share of the heads, and back."""
        if attn_mask is not None:
            raise ValueError(f"strategy.context_parallel_size={self.size}: {self.model_name}'s attention was given an"
                             " explicit mask (an attention_mask passed to the model, or one the model always builds,"
                             " as Falcon does), which cannot be exchanged across shards; context parallelism runs"
                             " causal attention called without a mask")
        heads = [query.shape[1], key.shape[1], value.shape[1]]
        if any(count % self.size for count in heads):
            raise ValueError(f"strategy.context_parallel_size={self.size}: all_to_all splits the attention heads"
                             f" ({heads[0]} query, {heads[1]} key/value) over {self.size} ranks; choose a size that"
                             " divides them")
        extra = {"enable_gqa": True} if enable_gqa else {}

        def attend(q: Any, k: Any, v: Any) -> Any:
            return self._original(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra)

        return self.exchange(query, key, value, attend)


class RingContextParallel(ContextParallel):
    """torch's ring attention over `mesh` (the context-parallel ranks, 1-D): each rank keeps its heads, and torch's
    context-parallel SDPA passes the key/value shards round the ranks (CUDA's flash, efficient or cuDNN kernels).
    The shards are those torch makes of the batch under causal load balancing, read from torch itself."""

    def __init__(self, mesh: Any, rank: int, size: int, device: Any = "cpu") -> None:
        super().__init__(mesh.get_group(), rank, size, device)
        self.mesh = mesh
        self._orders: dict[int, Any] = {}
        self._length: int | None = None

    def expect_exchanges(self, model: Any, block_classes: tuple[type, ...], recomputes: bool) -> None:
        """Nothing to count: torch's own exchange, on CUDA."""

    def order(self, length: int) -> Any:
        """The positions of a `length`-token sequence this rank holds, in torch's order."""
        from lightning_dist._compat.torch import ring_attention

        if length not in self._orders:
            with ring_attention(self.mesh, length, self.device) as held:
                self._orders[length] = held
        return self._orders[length]

    def shard(self, batch: Any) -> Any:
        import torch

        from lightning_dist._compat.torch import tree_map

        def cut(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                return value
            if value.shape[1] % (2 * self.size):
                raise ValueError(f"strategy.context_parallel_size={self.size}: a batch of sequences of"
                                 f" {value.shape[1]} tokens does not split into 2 x {self.size} equal chunks")
            self._length = value.shape[1]
            return value.index_select(1, self.order(value.shape[1]).to(value.device))

        return tree_map(cut, batch)

    def held_positions(self, positions: Any) -> Any:
        return self.order(positions.shape[-1] * self.size).to(positions.device)[positions]

    @contextmanager
    def attention(self) -> Iterator[None]:
        from lightning_dist._compat.torch import ring_attention

        if self._length is None:
            raise RuntimeError("RingContextParallel.attention: no batch sharded yet, so no sequence length is known")
        with ring_attention(self.mesh, self._length, self.device):
            yield


def context_parallel_of(style: str, mesh: Any, rank: int, size: int, device: Any) -> ContextParallel:
    """This rank's part of its context-parallel group (`mesh`: the 1-D mesh of its ranks), exchanging attention
    by `style`."""
    if style == "ring":
        return RingContextParallel(mesh, rank, size, device)
    return ContextParallel(mesh.get_group(), rank, size, device)


def all_to_all_attention(query: Any, key: Any, value: Any, attend: Callable[[Any, Any, Any], Any], group: Any,
                         size: int) -> Any:
    """Ulysses with torch's differentiable all-to-all over `group` (of `size` ranks): each (B, H, T/cp, D) shard's
    heads exchanged for the whole sequence of H/cp of them, `attend` run on those, and the output exchanged back."""
    whole = [_heads_for_sequence(t, group, size) for t in (query, key, value)]
    return _sequence_for_heads(attend(*whole), group, size)


def _heads_for_sequence(x: Any, group: Any, size: int) -> Any:
    """(B, H, T/cp, D) of this shard -> (B, H/cp, T, D): the whole sequence for this rank's share of heads."""
    batch, heads, length, dim = x.shape
    chunks = x.reshape(batch, size, heads // size, length, dim).transpose(0, 1).contiguous()
    received = _all_to_all(chunks, group)  # chunk i: sequence shard i, our heads
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, dim)


def _sequence_for_heads(x: Any, group: Any, size: int) -> Any:
    """(B, H/cp, T, D) -> (B, H, T/cp, D): back to this shard, every head."""
    batch, heads, length, dim = x.shape
    local = length // size
    chunks = x.reshape(batch, heads, size, local, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = _all_to_all(chunks, group)  # chunk i: head group i, our sequence shard
    return received.transpose(0, 1).reshape(batch, heads * size, local, dim)


def _all_to_all(chunks: Any, group: Any) -> Any:
    """Chunk i of dimension 0 to rank i of `group`, and theirs back, with gradients (backward is the reverse)."""
    from lightning_dist._compat.torch import all_to_all_with_gradients

    return all_to_all_with_gradients(chunks, group)
