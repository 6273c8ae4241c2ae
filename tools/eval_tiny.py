"""Evaluate a `metrale-tiny-code` checkpoint: bits per byte and MTP t+2 top-1 accuracy.

Owns the figures of issue 6. Over the WHOLE held-out validation set (and the dev set, and a
fixed sample of the training split) it computes:

- bits per byte = (sum over scored tokens of -log2 p(token | context)) / (UTF-8 bytes of the
  split's text). The split is scored as one stream `<|endoftext|>` f1 `<|endoftext|>` f2 ...
  fn `<|endoftext|>` (files in path order); every token after the leading separator is scored,
  the n separators included (so the figure is, if anything, slightly pessimistic).
- windowing: windows of `seq_len` (the training context, 1024) tokens advanced by `stride`
  (256): the first window scores all its targets, each later window only the targets not yet
  scored, so every token is predicted from min(its index, seq_len - stride) or more preceding
  tokens (at least 768 with the defaults), never crossing the training context.
- MTP top-1 accuracy for token t+2: at each scored position i the MTP head gets the main
  model's pre-norm hidden state h_i and the TRUE token i+1 (teacher forcing) and predicts
  token i+2; accuracy = fraction of argmax hits (positions whose token i+2 exists).
- main-model top-1 accuracy (t+1), for comparison.

Runs in float32 on the bfloat16 checkpoint weights (TF32 off). Checks the corpus hash against
the checkpoint's training_record.json: a different Python stdlib gives different held-out
text, so a mismatch is an error unless --allow-corpus-mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus as tc
from tiny_model import TinyQwen3, load_checkpoint

FIB_PROMPT = "def fibonacci(n):\n"


def plan_windows(n: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_target): inputs x[begin:end] predict x[begin+1:end+1]; targets with
    index >= first_target are scored. Every index in [1, n) is scored exactly once."""
    out: list[tuple[int, int, int]] = []
    prev_end = 0
    b = 0
    while prev_end < n - 1:
        e = min(b + seq_len, n - 1)
        out.append((b, e, max(prev_end + 1, b + 1)))
        prev_end = e
        b += stride
    return out


@torch.no_grad()
def score_stream(
    model: TinyQwen3, ids: list[int], seq_len: int, stride: int, device: torch.device, batch: int
) -> dict[str, float]:
    x = torch.tensor(ids, dtype=torch.long, device=device)
    n = x.numel()
    wins = plan_windows(n, seq_len, stride)
    nll = 0.0
    hit1 = 0
    n1 = 0
    mtp_nll = 0.0
    hit2 = 0
    n2 = 0
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in wins:
        groups.setdefault(w[1] - w[0], []).append(w)
    for length, ws in groups.items():
        for k in range(0, len(ws), batch):
            chunk = ws[k : k + batch]
            begins = torch.tensor([w[0] for w in chunk], device=device)
            idx = begins[:, None] + torch.arange(length + 1, device=device)
            win = x[idx]  # [b, length + 1]
            inp, tgt = win[:, :-1], win[:, 1:]
            positions = torch.arange(length, device=device)
            h = model.forward_hidden(inp, positions)
            logp = F.log_softmax(model.main_logits(h).float(), dim=-1)
            mtp_logp = F.log_softmax(model.mtp_logits(h, tgt, positions).float(), dim=-1)
            tok_nll = -logp.gather(-1, tgt[..., None])[..., 0]  # [b, length]
            pred1 = logp.argmax(-1)
            pos = torch.arange(length, device=device)[None, :]
            first = torch.tensor([w[2] - w[0] - 1 for w in chunk], device=device)[:, None]
            scored = pos >= first  # position p predicts index begin + p + 1
            nll += float(tok_nll[scored].sum())
            hit1 += int((pred1 == tgt)[scored].sum())
            n1 += int(scored.sum())
            # MTP at position p predicts index begin + p + 2, which must exist (< n)
            abs2 = begins[:, None] + pos + 2
            ok2 = scored & (abs2 < n)
            tgt2 = x[abs2.clamp(max=n - 1)]
            mtp_nll += float(-mtp_logp.gather(-1, tgt2[..., None])[..., 0][ok2].sum())
            hit2 += int((mtp_logp.argmax(-1) == tgt2)[ok2].sum())
            n2 += int(ok2.sum())
    if n1 != n - 1:
        raise AssertionError(f"scored {n1} tokens, expected {n - 1}")
    return {
        "tokens_scored": n1,
        "nll_nats": nll,
        "loss_nats_per_token": nll / n1,
        "top1_accuracy_t1": hit1 / n1,
        "mtp_positions": n2,
        "mtp_loss_nats_per_token": mtp_nll / max(1, n2),
        "mtp_top1_accuracy_t2": hit2 / max(1, n2),
        "windows": len(wins),
    }


def train_sample(files: list[tc.CorpusFile], target_bytes: int) -> list[tc.CorpusFile]:
    """Training files ordered by SHA-256 of their path, taken until target_bytes is reached."""
    order = sorted(files, key=lambda f: hashlib.sha256(f.path.encode()).hexdigest())
    out: list[tc.CorpusFile] = []
    total = 0
    for f in order:
        if total >= target_bytes:
            break
        out.append(f)
        total += f.num_bytes
    return sorted(out, key=lambda f: f.path)


@torch.no_grad()
def greedy(
    model: TinyQwen3, tok, prompt: str, max_new: int, device: torch.device
) -> dict[str, object]:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    prompt_len = len(ids)
    for _ in range(max_new):
        x = torch.tensor([ids[-model.cfg.max_position_embeddings :]], device=device)
        h = model.forward_hidden(x, torch.arange(x.shape[1], device=device))
        nxt = int(model.main_logits(h[:, -1:]).argmax(-1))
        ids.append(nxt)
        if nxt == tc.ENDOFTEXT_ID:
            break
    return {"prompt": prompt, "token_ids": ids[prompt_len:], "text": tok.decode(ids[prompt_len:])}


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(
        description="bits per byte + MTP accuracy of a tiny-code checkpoint"
    )
    p.add_argument(
        "checkpoint", help="checkpoint directory (config.json, model.safetensors, tokenizer.json)"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--stdlib", default=None, help="stdlib root (default: this interpreter's)")
    p.add_argument(
        "--seq-len", type=int, default=None, help="default: config max_position_embeddings"
    )
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--batch", type=int, default=None, help="windows per forward")
    p.add_argument("--train-sample-bytes", type=int, default=1_000_000, help="0: skip")
    p.add_argument("--splits", default="validation,dev,train_sample")
    p.add_argument("--max-files", type=int, default=None, help="smoke: first N files per split")
    p.add_argument("--allow-corpus-mismatch", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)

    t0 = time.time()
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batch = args.batch or (32 if device.type == "cuda" else 4)
    ckpt = Path(args.checkpoint)
    model = load_checkpoint(ckpt, device=device, dtype=torch.float32)
    seq_len = args.seq_len or model.cfg.max_position_embeddings
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    corpus = tc.build_corpus(args.stdlib)
    chash = corpus.corpus_hash()
    print(f"[eval_tiny] corpus sha256 {chash} ({corpus.root})", flush=True)
    rec_path = ckpt / "training_record.json"
    trained_hash = None
    if rec_path.exists():
        trained_hash = json.loads(rec_path.read_text())["corpus"]["corpus_sha256"]
        if trained_hash != chash:
            msg = f"corpus hash {chash} differs from the training corpus {trained_hash}"
            if not args.allow_corpus_mismatch:
                raise SystemExit(f"[eval_tiny] {msg} (use --allow-corpus-mismatch)")
            print(f"[eval_tiny] WARNING: {msg}", flush=True)

    splits: dict[str, list[tc.CorpusFile]] = {
        "validation": corpus.validation,
        "dev": corpus.dev,
    }
    if args.train_sample_bytes > 0:
        splits["train_sample"] = train_sample(corpus.train, args.train_sample_bytes)
    result: dict[str, object] = {
        "checkpoint": str(ckpt),
        "checkpoint_sha256": tc.sha256_file(ckpt / "model.safetensors"),
        "tokenizer_sha256": tc.sha256_file(ckpt / "tokenizer.json"),
        "corpus_sha256": chash,
        "corpus_matches_training": trained_hash == chash if trained_hash else None,
        "stdlib_root": corpus.root,
        "python": sys.version.split()[0],
        "device": str(device)
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "dtype": "float32 (bf16 weights upcast)",
        "windowing": {
            "seq_len": seq_len,
            "stride": args.stride,
            "min_context_after_first_window": seq_len - args.stride,
            "stream": "<|endoftext|> f1 <|endoftext|> f2 ... fn <|endoftext|>, files in path order; "
            "all tokens after the first scored, separators included",
        },
    }
    for name in args.splits.split(","):
        if name not in splits:
            continue
        files = splits[name][: args.max_files] if args.max_files else splits[name]
        ids = tc.token_stream(tok, files)
        nbytes = sum(f.num_bytes for f in files)
        r = score_stream(model, ids, seq_len, args.stride, device, batch)
        r["files"] = len(files)
        r["bytes"] = nbytes
        r["bytes_per_token"] = nbytes / (len(ids) - 1 - len(files))
        r["bits_per_byte"] = r["nll_nats"] / math.log(2) / nbytes
        if name != "train_sample":
            r["file_list"] = [f.path for f in files]
        result[name] = r
        print(
            f"[eval_tiny] {name}: {r['bits_per_byte']:.4f} bits/byte, "
            f"loss {r['loss_nats_per_token']:.4f} nats/token, top1 t+1 {r['top1_accuracy_t1']:.4f}, "
            f"MTP top1 t+2 {r['mtp_top1_accuracy_t2']:.4f} ({len(files)} files, {nbytes} bytes, "
            f"{r['tokens_scored']} tokens)",
            flush=True,
        )
    result["greedy_fibonacci"] = greedy(model, tok, FIB_PROMPT, 64, device)
    print(
        f"[eval_tiny] greedy {FIB_PROMPT!r} -> {result['greedy_fibonacci']['text']!r}", flush=True
    )
    result["eval_seconds"] = time.time() - t0
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
