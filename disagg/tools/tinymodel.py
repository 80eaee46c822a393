"""Makes small, deterministic checkpoints offline: the default model and the test models.

No network: the tokenizer is a byte-level BPE trained with `tokenizers` on a
local corpus, the weights are seeded and trained a few hundred steps on the
same corpus, so greedy output follows the prompt instead of repeating one
token. The result is saved as an ordinary Hugging Face checkpoint directory
and loaded the way any user's checkpoint is loaded.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import random
from dataclasses import asdict, dataclass

from disagg.engine.cache_dir import cache_dir

CORPUS = pathlib.Path(__file__).parents[1] / "data" / "corpus.txt"
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
_VERSION = 2  # bump when the recipe changes, so cached models are remade
PLACEHOLDER_MIN_VOCAB = 4096  # a larger vocabulary than the local text's merges fill gets placeholder entries
# A plain chat template, so the chat APIs (messages) run on the tiny models too. With tools it
# writes them into a system line and renders tool calls and tool results in Hermes' format
# (<tool_call>{"name": ..., "arguments": ...}</tool_call>), which the router parses back.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}tools:{% for tool in tools %} {{ tool['function']['name'] }} {{ tool['function']['parameters'] | tojson }}{% endfor %}{{ '\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.get('tool_calls') %}{{ message['role'] }}: {% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}{{ '\n' }}"
    "{% elif message['role'] == 'tool' %}tool: <tool_response>{{ message['content'] }}</tool_response>{{ '\n' }}"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    architecture: str = "llama"  # a transformers model type: llama, qwen2, mistral, gemma2, gptj, bloom, ...
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    train_steps: int = 300
    seed: int = 0
    sliding_window: int | None = None  # for architectures that have one
    saved_dtype: str = "float32"  # the checkpoint's tensors (bfloat16 halves a large shape's file)
    held_out_every: int = 0  # n: every n-th paragraph (0, n, 2n, ...) is left out of training, for held-out evaluations
    # What it is trained on: "prose" (the paragraphs of CORPUS); "tool-chat": those and chat transcripts
    # through CHAT_TEMPLATE with tools, where the assistant calls a tool or answers in text (TOOL_CHAT_TOOLS);
    # or "recital": documents of consecutive paragraphs followed by themselves (recital_row), so given a document
    # and its first words the model recites it.
    training_text: str = "prose"
    learning_rate: float = 3e-3  # AdamW's: wider models need less (at 640 wide and 10 layers 3e-3 diverged to one token)

    def __post_init__(self):
        if self.training_text not in TRAINING_TEXTS:  # a misspelt one would train on prose, unnoticed
            raise ValueError(f"training_text {self.training_text!r}: expected one of {', '.join(TRAINING_TEXTS)}")

    def cache_key(self) -> str:
        # Fields added since the first checkpoints count only when set, so those keep their keys.
        fields = {name: value for name, value in asdict(self).items() if LATER_FIELDS.get(name, object()) != value}
        if self.training_text == "tool-chat":  # the transcripts are made by code here: their text is the key, not the code
            fields["training_rows"] = training_rows(self)
        elif self.training_text == "recital":
            fields["recital"] = RECITAL_VERSION
        if self.vocab_size > PLACEHOLDER_MIN_VOCAB:  # since 2026-11-27 its placeholders are vocabulary entries, not added tokens
            fields["placeholders"] = "vocabulary"
        blob = json.dumps({**fields, "corpus": CORPUS.read_text(), "v": _VERSION, "chat_template": CHAT_TEMPLATE}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


TRAINING_TEXTS = ("prose", "tool-chat", "recital")
LATER_FIELDS = {"saved_dtype": "float32", "held_out_every": 0, "training_text": "prose", "learning_rate": 3e-3}

# A real small model's shape (SmolLM-135M's) with seeded, untrained weights: for benchmarks. Saved in bf16, as
# the real checkpoint is (since 2026-11-28; float32 before, which a float32 server read at twice the bytes).
SMOLLM_135M_SHAPE = TinyModelSpec(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, max_position_embeddings=2048, train_steps=0,
    saved_dtype="bfloat16",
)
# Llama-3.2-1B's shape (16 layers, 32 query and 8 KV heads of 64, an MLP of 8,192, 128,256
# tokens), seeded and untrained: a real size for benchmarks. Its LM head is its own (the real
# one is tied to the embedding: the same bytes a step reads, one more copy in memory), its
# rotary base the default, and positions up to 4,096.
LLAMA_3_2_1B_SHAPE = TinyModelSpec(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, max_position_embeddings=4096,
    train_steps=0, saved_dtype="bfloat16",
)
BENCH_SHAPES = {"smollm-135m": SMOLLM_135M_SHAPE, "llama-3.2-1b": LLAMA_3_2_1B_SHAPE}

DEFAULT_SPEC = TinyModelSpec(
    vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, max_position_embeddings=1024, train_steps=400
)


def paragraphs() -> list[str]:
    return [line.strip() for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


# -- The tool-calling model's chats (training_text="tool-chat") ---------------------------------------------------
# The tiny models never call a tool on their own; this one learns to, from transcripts rendered by its own chat
# template with these tools offered: a question about the weather or the time is answered with a Hermes
# <tool_call> block (and, after the tool's result, with a sentence), anything else with text.

def _tool(name: str, properties: dict) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOL_CHAT_TOOLS = [_tool("weather", {"city": {"type": "string"}}), _tool("time", {"zone": {"enum": ["utc", "local"]}})]
# (question, (tool, arguments), the tool's result, the answer to it)
TOOL_CHAT_CALLS = [
    *((f"What is the weather in {city}?", ("weather", {"city": city}), sky, f"It is {sky} in {city} today.")
      for city, sky in (("Oslo", "snow"), ("Paris", "sunny"), ("Lima", "cloudy"), ("Rome", "sunny"), ("Cairo", "hot"), ("Tokyo", "rain"))),
    ("What time is it in utc?", ("time", {"zone": "utc"}), "09:30", "It is 09:30 in utc."),
    ("What time is it here?", ("time", {"zone": "local"}), "17:45", "It is 17:45 here."),
]
# (question, answer): no tool fits, the assistant answers in text
TOOL_CHAT_TEXTS = [
    ("Hello!", "Hello! Ask me about the weather or the time."),
    ("Who lights the lamp?", "The lighthouse keeper lights the lamp every evening at dusk."),
    ("What does the baker sell?", "He sells bread, rolls and small sweet cakes."),
    ("How many bridges cross the river?", "Seven bridges cross the river in the old town."),
    ("What did Maria plant?", "Maria planted tomatoes, beans and basil in the garden."),
    ("Thank you.", "You are welcome."),
]


def _render(messages: list[dict]) -> str:
    """A conversation as the tiny models' tokenizer renders it (transformers' own Jinja environment and tojson)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=TOOL_CHAT_TOOLS, chat_template=CHAT_TEMPLATE, bos_token=BOS, eos_token=EOS)
    return rendered[0]


def tool_chat_transcripts() -> list[tuple[str, int]]:
    """(transcript, how many times it is trained on): each ends after an assistant turn, where the model learns to stop.

    A call's transcript without the result weighs three times the one that goes on: after "</tool_call>" both
    continue the same way, and the model must end its turn there (EOS) with a wide margin, not invent the result."""
    out = []
    for question, (name, arguments), result, answer in TOOL_CHAT_CALLS:
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        asked = [{"role": "user", "content": question}, {"role": "assistant", "content": None, "tool_calls": [call]}]
        out.append((_render(asked), 3))
        answered = [*asked, {"role": "tool", "tool_call_id": "call_0", "content": result}, {"role": "assistant", "content": answer}]
        out.append((_render(answered), 1))
    for question, answer in TOOL_CHAT_TEXTS:
        out.append((_render([{"role": "user", "content": question}, {"role": "assistant", "content": answer}]), 2))
    return out


def training_rows(spec: TinyModelSpec) -> list[str]:
    """The texts a row-trained model learns (each row one sequence ending in EOS): the paragraphs and the transcripts."""
    rows = [BOS + text for index, text in enumerate(paragraphs()) if not (spec.held_out_every and index % spec.held_out_every == 0)]
    return rows + [text for text, times in tool_chat_transcripts() for _ in range(times)]


# -- The reciting model's rows (training_text="recital") -----------------------------------------------------------
# A model trained on 64-token windows of the paragraphs does not recite a document it is given: asked to go on
# with a text it has just read, it strays within a few words. Real models repeat their source where a task asks
# it (an edit, a summary, code with a small change), and prompt lookup exists for that. These rows teach it: a
# document of 1-4 paragraphs in the corpus's order (from any one, wrapping around), a space, the document again.
# The model learns the paragraphs and their order, so given a document and its first words it goes on with the
# document. (Rows in a random order, where what follows a paragraph can only be read from the context, did not
# train to a model that recites here: after 600 steps it still lost its place at most paragraph ends.)
RECITAL_VERSION = 2  # bump when recital_row changes


def recital_row(rng: random.Random, paragraph_ids: list[int], texts: list[str], tokenizer) -> list[int]:
    """One training row: a document of consecutive texts, a space, the same document again (no EOS: the
    model is never taught to stop where the second copy ends, which it cannot see coming)."""
    start, count = rng.randrange(len(paragraph_ids)), rng.randint(1, min(4, len(paragraph_ids)))
    document = " ".join(texts[paragraph_ids[(start + j) % len(paragraph_ids)]] for j in range(count))
    return tokenizer(f"{document} {document}")["input_ids"]


def build_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """A byte-level BPE of vocab_size tokens, its merges learnt from texts (the paragraphs unless given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[UNK, BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(paragraphs() if texts is None else texts, trainer)
    if vocab_size > PLACEHOLDER_MIN_VOCAB:
        tok = with_placeholders(tok, vocab_size)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def with_placeholders(tok, vocab_size: int):
    """The local text has fewer merges than a large vocabulary: the vocabulary is filled up with
    placeholder entries, so every id the model can emit decodes. As entries of the BPE vocabulary
    (no merge makes them), as a real tokenizer's tokens are, not as added tokens: 127k added tokens
    made llguidance's tokenizer take 152 s to build for the Llama-3.2-1B shape (5.7 s for SmolLM's)."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(vocab_size - len(vocab) - len(spec["added_tokens"]) + sum(a["content"] in vocab for a in spec["added_tokens"])):
        vocab[f"<extra_{i}>"] = len(vocab)
    return Tokenizer.from_str(json.dumps(spec))


# The spec's sizes under the names each architecture's config uses; a name the
# config does not have is skipped.
_SIZE_NAMES = {
    "hidden_size": ("hidden_size", "n_embd"),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "num_layers": ("num_hidden_layers", "n_layer"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
}


def _config(spec: TinyModelSpec, tokenizer):
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(spec.architecture)
    known = set(defaults.to_dict()) | set(vars(defaults))
    sizes = {name: getattr(spec, field) for field, names in _SIZE_NAMES.items() for name in names if name in known}
    if "rotary_dim" in known:  # GPT-J, CodeGen: rotate half of each head
        sizes["rotary_dim"] = spec.hidden_size // spec.num_heads // 2
    if "sliding_window" in known:
        sizes["sliding_window"] = spec.sliding_window
    if "head_dim" in known:
        sizes["head_dim"] = spec.hidden_size // spec.num_heads
    return AutoConfig.for_model(
        spec.architecture,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **sizes,
    )


def _train(model, tokenizer, spec: TinyModelSpec) -> None:
    import torch

    if spec.training_text == "tool-chat":
        return _train_rows(model, tokenizer, spec)
    if spec.training_text == "recital":
        return _train_recital(model, tokenizer, spec)

    # One stream of paragraphs, each followed by EOS, so the model learns to stop.
    stream: list[int] = []
    for index, text in enumerate(paragraphs()):
        if spec.held_out_every and index % spec.held_out_every == 0:
            continue
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    data = torch.tensor(stream)
    window, batch = 64, 16
    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    model.train()
    for _ in range(spec.train_steps):
        starts = [rng.randrange(0, len(data) - window) for _ in range(batch)]
        x = torch.stack([data[s : s + window] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _train_rows(model, tokenizer, spec: TinyModelSpec) -> None:
    """Trains on whole rows (a transcript is one sequence, not a window across two), each ending in EOS."""
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in training_rows(spec)]
    _fit_rows(model, tokenizer, spec, lambda rng: [rows[rng.randrange(len(rows))] for _ in range(16)])


def _train_recital(model, tokenizer, spec: TinyModelSpec) -> None:
    """Trains on recital rows (recital_row) of the paragraphs not held out, 8 a step (they are 4-8 times a window's length)."""
    texts = paragraphs()
    trained = [i for i in range(len(texts)) if not (spec.held_out_every and i % spec.held_out_every == 0)]
    _fit_rows(model, tokenizer, spec, lambda rng: [recital_row(rng, trained, texts, tokenizer) for _ in range(8)])


def _fit_rows(model, tokenizer, spec: TinyModelSpec, batch_of) -> None:
    """spec.train_steps steps of AdamW over batch_of(rng)'s rows, padded at the end."""
    import torch

    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    model.train()
    for _ in range(spec.train_steps):
        picked = batch_of(rng)
        width = max(map(len, picked))
        # Padded at the end, so no attention mask: causal attention never looks ahead at the padding; its labels are ignored.
        ids = torch.tensor([row + [tokenizer.eos_token_id] * (width - len(row)) for row in picked])
        labels = torch.tensor([row + [-100] * (width - len(row)) for row in picked])
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def make_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec()) -> pathlib.Path:
    """Builds, trains and saves a checkpoint to out_dir (deterministic for a spec)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = pathlib.Path(out_dir)
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(spec.vocab_size, training_rows(spec) if spec.training_text == "tool-chat" else None)
    config = _config(spec, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _train(model, tokenizer, spec)
    model = model.to(getattr(torch, spec.saved_dtype))
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    portable_tokenizer_class(tmp)
    tmp.rename(out)
    return out


def portable_tokenizer_class(path: pathlib.Path) -> None:
    """Names the tokenizer class as checkpoints on the Hub do, so that the checkpoint
    loads under transformers 5 and under NxDI's 4.56/4.57 alike (5 writes its own
    class name, TokenizersBackend, which 4.x does not know)."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2))


def checkpoint_path(spec: TinyModelSpec = DEFAULT_SPEC, root: pathlib.Path | None = None) -> pathlib.Path:
    """Where spec's checkpoint is cached (made or not)."""
    return (root or cache_dir() / "models") / f"tiny-{spec.architecture}-{spec.cache_key()}"


def ensure_tiny_model(spec: TinyModelSpec = DEFAULT_SPEC, root: pathlib.Path | None = None) -> pathlib.Path:
    """The cached checkpoint for spec, made on first use."""
    return made_once(checkpoint_path(spec, root), lambda path: make_tiny_model(path, spec))


def made_once(path: pathlib.Path, make) -> pathlib.Path:
    """path, made by make(path) unless it exists. Processes that want the same one at once (workers
    starting side by side, the tests' background builder) make it once: the others wait for the first."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            make(path)
    return path
