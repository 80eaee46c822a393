"""EAGLE (v1, flat): a draft head over the target's own features, as NxDI's `enable_eagle_speculation` takes it.

The head reads, for each position q of the sequence, the target's final hidden state h_q (after its
final norm: what its LM head multiplies) and the embedding of the token after it, t_{q+1}:

    x_q = fc([embed(t_{q+1}), h_q])  ->  decoder layer(s) over the earlier x's  ->  o_q  ->  target's LM head  ->  t_{q+2}

and guesses on from its own output: o_q stands in for h_{q+1} beside the guessed token. Its layers have
no input norm (unless the checkpoint has one) and no final norm; the embedding and the LM head are the
target's. The checkpoint is named as NxDI's EAGLE draft: a Llama config of the target's width and a state dict of
`fc.weight` (2 x hidden in, hidden out; `fc.bias` where config `fc_bias`) and `layers.N.*` as a Llama
layer's; `embed_tokens`, `lm_head` and `norm` there are ignored (the target's serve).

On the decode worker (EagleProposer), every target step's hidden states go into a small ring per slot
(`recent`, keyed by position); when a row guesses, the head first takes in the positions it has not seen
(its K/V per slot, keys rotated by their position, so a gap past the ring only loses context, never
exactness), then guesses greedily. A sequence's first pair is at the position of its first decode step's
input: the prompt's hidden states stay on the prefill worker (the head's context starts at the decode).
"""

from __future__ import annotations

import json
import pathlib

import torch
from torch import nn

from ..backends import Backend
from ..cpu_kernels.greedy import greedy_ids
from . import MAX_SPECULATIVE_TOKENS
from .rows import RowSpeculation

# Recent positions' hidden states kept per slot; a ring, so the guesses' rows (past the newest kept position,
# up to MAX_SPECULATIVE_TOKENS of them) must not reach the oldest position the head still reads.
RECENT_POSITIONS = 64 + MAX_SPECULATIVE_TOKENS
READABLE_POSITIONS = RECENT_POSITIONS - MAX_SPECULATIVE_TOKENS - 1

_IGNORED = ("embed_tokens.weight", "lm_head.weight", "norm.weight")  # the target's serve


class _RmsNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()  # as transformers' RMSNorm: the statistics in float32 whatever the head's dtype
        return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)


class _Mlp(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config, input_norm: bool):
        super().__init__()
        self.input_layernorm = _RmsNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = _RmsNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _Mlp(config)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class EagleHead(nn.Module):
    """The head's own weights (fc and layers); embed and lm_head are the target's, passed in."""

    def __init__(self, config, input_norm: bool = False, fc_bias: bool = False):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([_Layer(config, input_norm) for _ in range(config.num_hidden_layers)])
        self.rotary = LlamaRotaryEmbedding(config)

    def _angles(self, positions: torch.Tensor, like: torch.Tensor):
        cos, sin = self.rotary(like, positions.reshape(1, -1))
        return cos.reshape(*positions.shape, -1), sin.reshape(*positions.shape, -1)

    def sequence(self, features: torch.Tensor) -> torch.Tensor:
        """Training: [B, T, 2H] pairs (embedding, hidden) of consecutive positions -> [B, T, H], causal."""
        x = self.fc(features)
        batch, length, _ = x.shape
        cos, sin = self._angles(torch.arange(length), x)
        for layer in self.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x) if layer.input_layernorm is not None else x
            q = _rotate(attn.q_proj(h).view(batch, length, attn.heads, -1).transpose(1, 2), cos, sin)
            k = _rotate(attn.k_proj(h).view(batch, length, attn.kv_heads, -1).transpose(1, 2), cos, sin)
            v = attn.v_proj(h).view(batch, length, attn.kv_heads, -1).transpose(1, 2)
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.heads != attn.kv_heads)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def cached(self, features: torch.Tensor, slots: list[int], positions: torch.Tensor, cache: "EagleCache") -> torch.Tensor:
        """Serving: [n, 2H] rows, each a slot's next pair (a slot's rows consecutive, in order) -> [n, H]. Each row's
        K/V is appended to its slot's and it attends over its slot's lines up to its own."""
        x = self.fc(features)
        cos, sin = self._angles(positions, x)
        lines = cache.append(slots)  # each row's line in its slot
        ends = torch.tensor([line + 1 for line in lines])
        width = int(ends.max())
        visible = (torch.arange(width)[None, :] < ends[:, None])[:, None, None, :]  # [n, 1, 1, width]
        slot_index = torch.tensor(slots)
        flat_lines = slot_index * cache.lines + torch.tensor(lines)
        for layer, (keys, values) in zip(self.layers, cache.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x) if layer.input_layernorm is not None else x
            # The attention in the cache's dtype (float32: a bf16 one cost 5x as much at these sizes).
            q = _rotate(attn.q_proj(h).view(-1, attn.heads, attn.head_dim), cos[:, None], sin[:, None]).to(keys.dtype)
            # index_copy_ over the slots' flat lines (index_put_ with two index tensors cost a millisecond here).
            keys.view(-1, attn.kv_heads, attn.head_dim).index_copy_(
                0, flat_lines, _rotate(attn.k_proj(h).view(-1, attn.kv_heads, attn.head_dim), cos[:, None], sin[:, None]).to(keys.dtype))
            values.view(-1, attn.kv_heads, attn.head_dim).index_copy_(0, flat_lines, attn.v_proj(h).view(-1, attn.kv_heads, attn.head_dim).to(keys.dtype))
            k, v = keys[slot_index, :width].transpose(1, 2), values[slot_index, :width].transpose(1, 2)  # [n, kv_heads, width, d]
            out = nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible, enable_gqa=attn.heads != attn.kv_heads)
            x = x + attn.o_proj(out.reshape(x.shape[0], -1).to(x.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x


class EagleCache:
    """The head's K/V per slot, per layer [slots, lines, kv_heads, head_dim], filled in order from line 0."""

    def __init__(self, head: EagleHead, num_slots: int, lines: int):
        attn = head.layers[0].self_attn
        self.lines = lines
        shape = (num_slots, lines, attn.kv_heads, attn.head_dim)
        self.layers = [(torch.zeros(shape), torch.zeros(shape)) for _ in head.layers]
        self.lengths = [0] * num_slots

    def append(self, slots: list[int]) -> list[int]:
        lines = []
        for slot in slots:
            lines.append(self.lengths[slot])
            self.lengths[slot] += 1
        return lines


def _state_dict(path: pathlib.Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state = {}
        for file in files:
            state.update(load_file(str(file)))
    elif (path / "pytorch_model.bin").exists():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"--draft-model {path}: no *.safetensors or pytorch_model.bin")
    return {(name[len("model."):] if name.startswith("model.") else name): tensor for name, tensor in state.items()}


def read_eagle_config(path: str):
    """The EAGLE checkpoint's Llama config (its own width must be the target's)."""
    from transformers import LlamaConfig

    config_file = pathlib.Path(path) / "config.json"
    if not config_file.exists():
        raise ValueError(f"--draft-model {path}: no config.json")
    return LlamaConfig(**{k: v for k, v in json.loads(config_file.read_text()).items() if k not in ("architectures", "model_type")})


def check_eagle_matches(target: str, eagle: str) -> None:
    """Raises ValueError naming the mismatch where the EAGLE head cannot read the target's features."""
    from transformers import AutoConfig

    target_config, config = AutoConfig.from_pretrained(target), read_eagle_config(eagle)
    target_width = getattr(target_config, "hidden_size", None)
    if config.hidden_size != target_width:
        raise ValueError(f"--draft-model {eagle}: an EAGLE head {config.hidden_size} wide for a model {target_width} wide")
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"--draft-model {eagle}: its vocabulary has {config.vocab_size} tokens, the model's {target_config.vocab_size}")


def load_eagle_head(path: str) -> EagleHead:
    """The head from NxDI's EAGLE draft checkpoint; a tensor missing, unknown or of the wrong shape is refused by name."""
    config = read_eagle_config(path)
    state = {name: t for name, t in _state_dict(pathlib.Path(path)).items() if name not in _IGNORED}
    if any(name.startswith(("midlayer.", "d2t", "t2d")) for name in state):
        raise ValueError(f"--draft-model {path}: an EAGLE-3 checkpoint (midlayer, d2t): only EAGLE v1 heads are served")
    input_norm = "layers.0.input_layernorm.weight" in state
    head = EagleHead(config, input_norm=input_norm, fc_bias="fc.bias" in state)
    expected = head.state_dict()
    for name, tensor in expected.items():
        if name not in state:
            raise ValueError(f"--draft-model {path}: no tensor {name}")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"--draft-model {path}: {name} is {tuple(state[name].shape)}, expected {tuple(tensor.shape)}")
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise ValueError(f"--draft-model {path}: tensor {unknown[0]} is not part of an EAGLE v1 head")
    head.load_state_dict({name: t.float() for name, t in state.items()})
    return head.eval()


class EagleProposer:
    """Runs on the device thread only (after_step, propose)."""

    on_device = True

    def __init__(self, backend: Backend, head: EagleHead, num_slots: int):
        from ..cpu_kernels.packed_linear import can_prepack, group_shared_inputs, prepack_linears

        # In the model's dtype and, on a CPU, through the same packed product kernels as its step: a head of the
        # model's width reads a layer's weights (and fc's) for each guess, so its bytes are what it costs.
        self.dtype = backend.dtype
        self.backend, self.head = backend, head.to(self.dtype)
        backend.keep_hidden = True  # each step's final hidden states: the head's input
        self.embed = backend.model.get_input_embeddings()
        self.lm_head = backend.model.get_output_embeddings()
        self.recent = torch.zeros(num_slots, RECENT_POSITIONS, head.config.hidden_size)
        self.cache = EagleCache(head, num_slots, backend.info.max_seq_len + MAX_SPECULATIVE_TOKENS + 1)
        if backend.device.type == "cpu" and can_prepack(backend.device, self.dtype):
            prepack_linears(self.head)
            with torch.inference_mode():  # q, k and v (gate and up) read one input: one product each group, as in the model's step
                group_shared_inputs(self.head, lambda: self._run([0], [0], [0], torch.zeros(1, head.config.hidden_size)))
            self.cache.lengths[0] = 0

    @torch.inference_mode()
    def after_step(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """The step's hidden states, by the position of each row's input token."""
        hidden = self.backend.step_hidden
        if hidden is not None:
            # index_copy_ on the rows' flat lines: index_put_ with two index tensors took 1.2 ms a 16-row step here, right
            # after the native step (0.2 ms this way), and this runs after every step, guessing or not.
            lines = slots * RECENT_POSITIONS + positions % RECENT_POSITIONS
            self.recent.view(-1, self.recent.shape[-1]).index_copy_(0, lines, hidden.to(self.recent.device, torch.float32))

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[RowSpeculation, int]]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in wanted]
        pairs = [self._unseen(row) for row, count in wanted]  # per row: its positions q to take in, oldest first
        live = [i for i, (_, count) in enumerate(wanted) if count > 0 and pairs[i]]
        if not live:
            return guesses
        slots, qs = [wanted[i][0].slot for i in live for _ in pairs[i]], [q for i in live for q in pairs[i]]
        tokens = [wanted[i][0].tokens[q + 1] for i in live for q in pairs[i]]
        out = self._run(slots, qs, tokens, self.recent[slots, torch.tensor(qs) % RECENT_POSITIONS])
        last_rows = torch.tensor([len(pairs[i]) for i in live]).cumsum(0) - 1
        features, caught_up = out[last_rows], list(self.cache.lengths)
        for step in range(max(wanted[i][1] for i in live)):
            guessed = self._greedy(features)
            for i, token in zip(live, guessed):
                guesses[i].append(token)
            live_next = [k for k, i in enumerate(live) if len(guesses[i]) < wanted[i][1]]
            if not live_next:
                break
            live = [live[k] for k in live_next]
            newest = [len(wanted[i][0].tokens) - 1 + step for i in live]  # the guess's own position: the pair's q
            features = self._run([wanted[i][0].slot for i in live], newest, [guesses[i][-1] for i in live], features[live_next])
        self.cache.lengths = caught_up  # the guesses' lines go: the next catch-up takes the target's own features there
        for row, count in wanted:
            if count > 0:
                row.draft_seen = len(row.tokens) - 1
        return guesses

    def _unseen(self, row: RowSpeculation) -> list[int]:
        """Positions q whose pair (t_{q+1}, h_q) the head has not taken in: from where it stopped (a new
        sequence: from its first decode step's, its slot's lines cleared), within the ring, up to the newest token's."""
        newest = len(row.tokens) - 1
        if row.draft_seen == 0:
            self.cache.lengths[row.slot] = 0
            row.draft_seen = row.first_position
        return list(range(max(row.draft_seen, newest - READABLE_POSITIONS + 1), newest))

    def _run(self, slots: list[int], positions: list[int], tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(torch.tensor(tokens, device=self.embed.weight.device)).cpu()
        features = torch.cat([embedded.to(self.dtype), hidden.to(self.dtype)], dim=-1)
        return self.head.cached(features, slots, torch.tensor(positions), self.cache)

    def _greedy(self, features: torch.Tensor) -> list[int]:
        return greedy_ids(self.lm_head(features.to(self.backend.device, self.dtype))).tolist()
