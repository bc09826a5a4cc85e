"""Write tiny.gguf (a 2-layer llama model with random weights) and tiny-lora.gguf (a LoRA adapter
for it) into a directory, for the tests that run a real llama-server (scripts/build-llama-server).

The text it generates is gibberish, but everything a router sees is the real engine's: tokenizing
with a real vocabulary, chat templating, prompt processing, the KV cache and its reuse, slots,
sampling, streaming, metrics and LoRA. The vocabulary (the tokenizer.* keys) is copied from one of
the vocab-only files in llama.cpp's source tree; the weights are seeded, so a run writes the same
bytes every time.

The shape is a contract with the tests: 2 layers of 4 query heads and 2 KV heads of 16 dimensions
in f16, i.e. 256 bytes of KV per token (tests/test_llamacpp_contract.py tells the simulator so), a
trained context of 4096, and a ChatML template.

Runs with llama.cpp's `gguf` package (its gguf-py/, matching the server) and numpy:
    python tiny_gguf.py --vocab LLAMA_CPP/models/ggml-vocab-llama-spm.gguf --out-dir DIR
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass(frozen=True)
class Shape:
    layers: int = 2
    embd: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 192
    ctx: int = 4096

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.kv_heads

    def weights(self) -> dict[str, tuple[int, int]]:
        """A layer's matrices as numpy shapes (rows = outputs, columns = inputs)."""
        e, kv, f = self.embd, self.kv_dim, self.ffn
        return {"attn_q": (e, e), "attn_k": (kv, e), "attn_v": (kv, e), "attn_output": (e, e),
                "ffn_gate": (f, e), "ffn_up": (f, e), "ffn_down": (e, f)}


def copy_vocabulary(vocab: Path, w: gguf.GGUFWriter) -> int:
    """Copy every tokenizer.* key but the chat template; return the number of tokens."""
    n = 0
    for f in gguf.GGUFReader(vocab).fields.values():
        if not f.name.startswith("tokenizer.") or f.name == "tokenizer.chat_template":
            continue
        kind = f.types[0]
        item = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), kind, sub_type=item)
        if f.name == "tokenizer.ggml.tokens":
            n = len(f.data)
    if not n:
        raise SystemExit(f"{vocab}: no tokenizer.ggml.tokens")
    return n


def write_model(path: Path, vocab: Path, s: Shape, rng: np.random.Generator) -> None:
    def matrix(rows: int, cols: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(np.float16)

    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("llmgw-tiny-llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.embd)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    n_vocab = copy_vocabulary(vocab, w)
    w.add_vocab_size(n_vocab)
    w.add_chat_template(CHATML)

    norm = np.ones(s.embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, s.embd), dtype=np.float32).astype(np.float16))
    # Its own output matrix (not tied to the embedding): greedy decoding then wanders through the
    # vocabulary instead of repeating the last token.
    w.add_tensor("output.weight", matrix(n_vocab, s.embd, scale=1.0))
    w.add_tensor("output_norm.weight", norm)
    for i in range(s.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
        for name, (rows, cols) in s.weights().items():
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, cols))
    _finish(w)
    print(f"wrote {path}: llama, {s.layers} layers, {n_vocab} tokens, embd {s.embd}, heads {s.heads}/{s.kv_heads}")


def write_lora(path: Path, s: Shape, rng: np.random.Generator, targets: tuple[str, ...] = ("attn_q", "attn_v"),
               rank: int = 4, alpha: float = 8.0) -> None:
    """A LoRA adapter as llama.cpp loads it: lora_a (rank x inputs) and lora_b (outputs x rank) per
    adapted matrix. B is random, not zero as in a fresh training run, so the adapter changes the output."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_name("llmgw-tiny-llama-lora")
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    shapes = s.weights()
    for i in range(s.layers):
        for t in targets:
            rows, cols = shapes[t]
            # f32 explicitly: numpy promotes a float32 array divided by a float64 scalar to f64,
            # and llama-server (this build) crashes on the first token with an f64 adapter.
            a = (rng.standard_normal((rank, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)
            b = (rng.standard_normal((rows, rank), dtype=np.float32) / np.sqrt(rank)).astype(np.float32)
            w.add_tensor(f"blk.{i}.{t}.weight.lora_a", a)
            w.add_tensor(f"blk.{i}.{t}.weight.lora_b", b)
    _finish(w)
    print(f"wrote {path}: LoRA rank {rank}, alpha {alpha}, on {', '.join(targets)}")


def _finish(w: gguf.GGUFWriter) -> None:
    # Only the types llama.cpp expects here: an f64 tensor is accepted by the writer but crashes
    # the server when it is used.
    for name, info in ((n, i) for shard in w.tensors for n, i in shard.items()):
        if info.dtype not in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
            raise SystemExit(f"{name}: {info.dtype.name} (want F16 or F32)")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="Write tiny.gguf and tiny-lora.gguf for a real llama-server.")
    ap.add_argument("--vocab", type=Path, required=True, help="a vocab-only GGUF from llama.cpp's models/ folder")
    ap.add_argument("--out-dir", type=Path, required=True, help="the folder to write tiny.gguf and tiny-lora.gguf into")
    ap.add_argument("--seed", type=int, default=20240613, help="seed of the random weights (default: %(default)s)")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    shape = Shape()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_model(args.out_dir / "tiny.gguf", args.vocab, shape, rng)
    write_lora(args.out_dir / "tiny-lora.gguf", shape, rng)


if __name__ == "__main__":
    main()
