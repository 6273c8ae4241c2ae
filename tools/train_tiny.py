"""Train `metrale-tiny-code`: tokenizer, Qwen3 model and its MTP head, from the CPython stdlib.

Owns the training recipe of issue 6. One command goes from the interpreter's standard library
to a Hugging Face-style checkpoint directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json, training_record.json):

  1. corpus: tools/tiny_corpus.py (sorted, deduplicated, fixed held-out lists); prints its hash;
  2. tokenizer: byte-level BPE, vocabulary 8,192, trained on the train split only;
  3. model: tools/tiny_model.py (Qwen3 + one MTP layer), bf16 autocast with float32 master
     weights, AdamW (decoupled weight decay on matrices only), linear warmup then cosine decay,
     gradient-norm clipping, loss = CE(next token) + mtp_weight * CE(token after next);
  4. data: the train split as one token stream (`<|endoftext|>` between files); each epoch
     cuts it into windows of seq_len + 2 tokens at a seeded random offset and visits them in
     a seeded random order;
  5. the step count is fixed by the command (`--steps`, or `--epochs` resolved against the
     tokenized corpus and capped by `--max-steps`), so a run is determined by seed + corpus;
     `--max-train-seconds` is only a safety net (the record says if it fired).

Determinism: seeds for init, data order and dropout; sorted files; on CUDA
`torch.use_deterministic_algorithms(True, warn_only=True)` (flash-attention backward may still
accumulate in a nondeterministic order, so two runs agree closely rather than bit for bit).

`--bench-steps N` measures training throughput on random tokens and exits (used to size the
step count on a new device).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus as tc
from tiny_model import TinyConfig, TinyQwen3, count_parameters, save_checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=False, help="checkpoint directory to write")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--stdlib", default=None, help="stdlib root (default: this interpreter's)")
    p.add_argument("--max-train-files", type=int, default=None, help="smoke runs only")
    p.add_argument("--vocab-size", type=int, default=8192)
    # architecture
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seq-len", type=int, default=1024)
    # optimisation
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--steps", type=int, default=None, help="fixed number of optimizer steps")
    p.add_argument("--epochs", type=float, default=None, help="resolve steps from the corpus")
    p.add_argument("--max-steps", type=int, default=None, help="cap for --epochs")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    # bookkeeping
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0, help="log dev-split loss every N steps")
    p.add_argument("--max-train-seconds", type=float, default=None, help="safety net only")
    p.add_argument("--bench-steps", type=int, default=0, help="throughput benchmark and exit")
    p.add_argument("--bench-barrier", default=None, help="bench: directory shared by N processes")
    p.add_argument("--bench-nproc", type=int, default=1, help="bench: processes to wait for")
    p.add_argument("--tag", default="", help="free-form label stored in the record")
    args = p.parse_args(argv)
    if not args.bench_steps:
        if args.out is None:
            p.error("--out is required")
        if (args.steps is None) == (args.epochs is None):
            p.error("give exactly one of --steps and --epochs")
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to peak * min_ratio."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def model_config(args: argparse.Namespace) -> TinyConfig:
    return TinyConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        rope_theta=args.rope_theta,
        max_position_embeddings=args.seq_len,
    )


def make_optimizer(model: TinyQwen3, args: argparse.Namespace, device: torch.device):
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2), eps=1e-8, **kw)


def train_step(
    model: TinyQwen3,
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,
    lr: float,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step on windows [B, T+2]. Returns (main loss, mtp loss, grad norm)."""
    t = args.seq_len
    ids, next_ids = batch[:, :t], batch[:, 1 : t + 1]
    targets, targets2 = batch[:, 1 : t + 1], batch[:, 2 : t + 2]
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits, mtp = model(ids, next_ids)
    v = logits.shape[-1]
    loss1 = F.cross_entropy(logits.float().reshape(-1, v), targets.reshape(-1))
    loss2 = F.cross_entropy(mtp.float().reshape(-1, v), targets2.reshape(-1))
    loss = loss1 + args.mtp_weight * loss2
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()
    return loss1.detach(), loss2.detach(), gnorm.detach()


def window_starts(
    n_tokens: int, seq_len: int, epochs_needed: int, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Start offsets of windows of seq_len + 2 tokens, epoch after epoch: each epoch a random
    offset in [0, seq_len) and a random order of the windows. Returns (starts, per_epoch)."""
    span = seq_len + 2
    out = []
    per_epoch = (n_tokens - span - (seq_len - 1)) // seq_len + 1
    if per_epoch < 1:
        raise ValueError(f"corpus of {n_tokens} tokens is too short for seq_len {seq_len}")
    for _ in range(epochs_needed):
        offset = int(torch.randint(0, seq_len, (1,), generator=gen))
        starts = offset + seq_len * torch.arange(per_epoch)
        out.append(starts[torch.randperm(per_epoch, generator=gen)])
    return torch.cat(out), per_epoch


@torch.no_grad()
def quick_val(
    model: TinyQwen3,
    stream: torch.Tensor,
    seq_len: int,
    device: torch.device,
    max_windows: int = 64,
) -> dict[str, float]:
    """Monitoring only (on the dev split): mean CE in nats/token, non-overlapping windows."""
    model.eval()
    n = (stream.numel() - 2) // seq_len
    n = min(n, max_windows)
    tot1 = tot2 = 0.0
    count = 0
    for i in range(0, n, 16):
        idx = torch.arange(i, min(i + 16, n), device=device)[:, None] * seq_len + torch.arange(
            seq_len + 2, device=device
        )
        batch = stream[idx]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, mtp = model(batch[:, :seq_len], batch[:, 1 : seq_len + 1])
        v = logits.shape[-1]
        tot1 += float(
            F.cross_entropy(
                logits.float().reshape(-1, v), batch[:, 1:-1].reshape(-1), reduction="sum"
            )
        )
        tot2 += float(
            F.cross_entropy(mtp.float().reshape(-1, v), batch[:, 2:].reshape(-1), reduction="sum")
        )
        count += batch.shape[0] * seq_len
    model.train()
    return {"dev_loss": tot1 / max(1, count), "dev_mtp_loss": tot2 / max(1, count)}


def write_tokenizer_files(tok, out: Path, seq_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tc.tokenizer_config(seq_len), indent=2) + "\n"
    )
    gen = {
        "bos_token_id": tc.ENDOFTEXT_ID,
        "eos_token_id": tc.ENDOFTEXT_ID,
        "pad_token_id": tc.ENDOFTEXT_ID,
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def device_info(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


def bench(args: argparse.Namespace) -> None:
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    cfg = model_config(args)
    model = TinyQwen3(cfg, dropout=args.dropout).to(device)
    model.init_weights(args.seed)
    opt = make_optimizer(model, args, device)
    batch = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 2), device=device)
    warm = 3
    t0 = 0.0
    for i in range(warm + args.bench_steps):
        if i == warm:
            if device.type == "cuda":
                torch.cuda.synchronize()
            if args.bench_barrier:  # time only while all N processes are running
                barrier = Path(args.bench_barrier)
                barrier.mkdir(parents=True, exist_ok=True)
                (barrier / f"ready.{os.getpid()}").touch()
                deadline = time.time() + 120
                while (
                    len(list(barrier.glob("ready.*"))) < args.bench_nproc and time.time() < deadline
                ):
                    time.sleep(0.05)
            t0 = time.perf_counter()
        train_step(model, opt, batch, args.lr, args, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.bench_steps
    print(
        "BENCH "
        + json.dumps(
            {
                "step_s": dt,
                "tokens_per_s": args.batch_size * args.seq_len / dt,
                **device_info(device),
            }
        ),
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    if args.bench_steps:
        bench(args)
        return {}
    t_start = time.time()
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python tools/train_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"[train_tiny] {command}", flush=True)

    corpus = tc.build_corpus(args.stdlib, args.max_train_files)
    stats = corpus.stats()
    print(f"[train_tiny] corpus sha256 {stats['corpus_sha256']}", flush=True)
    print(
        f"[train_tiny] stdlib {corpus.root}: train {stats['train']} dev {stats['dev']} "
        f"validation {stats['validation']}",
        flush=True,
    )
    tok = tc.train_tokenizer([f.text for f in corpus.train], args.vocab_size)
    write_tokenizer_files(tok, out, args.seq_len)
    tok_sha = tc.sha256_file(out / "tokenizer.json")
    print(f"[train_tiny] tokenizer sha256 {tok_sha} vocab {tok.get_vocab_size()}", flush=True)
    train_ids = torch.tensor(tc.token_stream(tok, corpus.train), dtype=torch.long)
    dev_ids = torch.tensor(tc.token_stream(tok, corpus.dev), dtype=torch.long)
    n_train = train_ids.numel()
    t_prep = time.time() - t_start
    print(
        f"[train_tiny] train tokens {n_train} ({stats['train']['bytes'] / n_train:.3f} bytes/token), "
        f"prep {t_prep:.1f}s",
        flush=True,
    )

    per_epoch = (n_train - (args.seq_len + 2) - (args.seq_len - 1)) // args.seq_len + 1
    if args.steps is not None:
        steps = args.steps
    else:
        steps = math.ceil(args.epochs * per_epoch / args.batch_size)
        if args.max_steps is not None:
            steps = min(steps, args.max_steps)
    steps = max(1, steps)
    epochs_needed = math.ceil(steps * args.batch_size / per_epoch) + 1
    gen = torch.Generator().manual_seed(args.seed)
    starts, per_epoch = window_starts(n_train, args.seq_len, epochs_needed, gen)
    warmup = max(1, round(args.warmup_frac * steps))
    print(
        f"[train_tiny] steps {steps} x {args.batch_size} x {args.seq_len} tokens "
        f"= {steps * args.batch_size / per_epoch:.2f} epochs of {per_epoch} windows",
        flush=True,
    )

    cfg = model_config(args)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise RuntimeError("tokenizer vocabulary exceeds the model's")
    model = TinyQwen3(cfg, dropout=args.dropout)
    model.init_weights(args.seed)
    model.to(device).train()
    params = count_parameters(model)
    print(f"[train_tiny] parameters {params}", flush=True)
    opt = make_optimizer(model, args, device)
    train_dev = train_ids.to(device)
    dev_stream = dev_ids.to(device)
    offs = torch.arange(args.seq_len + 2, device=device)
    torch.manual_seed(args.seed + 1)  # dropout stream
    if device.type == "cuda":
        torch.cuda.manual_seed_all(args.seed + 1)

    history: list[dict[str, float]] = []
    stopped_early = False
    t_train0 = time.time()
    step = 0
    for step in range(steps):
        if args.max_train_seconds is not None and time.time() - t_train0 > args.max_train_seconds:
            stopped_early = True
            print(f"[train_tiny] SAFETY NET: stopping at step {step} of {steps}", flush=True)
            break
        s = starts[step * args.batch_size : (step + 1) * args.batch_size].to(device)
        batch = train_dev[s[:, None] + offs]
        lr = lr_at(step, steps, args.lr, warmup, args.min_lr_ratio)
        l1, l2, gn = train_step(model, opt, batch, lr, args, device)
        last = step == steps - 1
        if (step + 1) % args.log_every == 0 or last or step == 0:
            l1f, l2f, gnf = float(l1), float(l2), float(gn)
            el = time.time() - t_train0
            tps = (step + 1) * args.batch_size * args.seq_len / max(el, 1e-9)
            rec = {
                "step": step + 1,
                "loss": l1f,
                "mtp_loss": l2f,
                "grad_norm": gnf,
                "lr": lr,
                "elapsed_s": el,
            }
            if args.eval_every and ((step + 1) % args.eval_every == 0 or last):
                rec.update(quick_val(model, dev_stream, args.seq_len, device))
            history.append(rec)
            print(
                f"[train_tiny] step {step + 1}/{steps} loss {l1f:.4f} mtp {l2f:.4f} gn {gnf:.3f} "
                f"lr {lr:.2e} {tps / 1e3:.0f}k tok/s {el:.0f}s"
                + (
                    f" dev {rec['dev_loss']:.4f} dev_mtp {rec['dev_mtp_loss']:.4f}"
                    if "dev_loss" in rec
                    else ""
                ),
                flush=True,
            )
    steps_done = step + 1 if not stopped_early else step
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_train = time.time() - t_train0

    save_checkpoint(model, out)
    tail = [h for h in history if h["step"] > steps_done * 0.9] or history[-1:]
    record: dict[str, object] = {
        "model_name": "metrale-tiny-code",
        "command": command,
        "tag": args.tag,
        "args": vars(args),
        "seed": args.seed,
        "steps": steps,
        "steps_done": steps_done,
        "stopped_early_by_safety_net": stopped_early,
        "warmup_steps": warmup,
        "windows_per_epoch": per_epoch,
        "epochs": steps_done * args.batch_size / per_epoch,
        "tokens_seen": steps_done * args.batch_size * args.seq_len,
        "train_tokens": n_train,
        "corpus": stats,
        "tokenizer_sha256": tok_sha,
        "tokenizer_vocab_size": tok.get_vocab_size(),
        "parameters": params,
        "checkpoint_sha256": tc.sha256_file(out / "model.safetensors"),
        "checkpoint_bytes": (out / "model.safetensors").stat().st_size,
        "final_train_loss_last10pct": sum(h["loss"] for h in tail) / len(tail),
        "final_train_mtp_loss_last10pct": sum(h["mtp_loss"] for h in tail) / len(tail),
        "history": history,
        "prep_seconds": t_prep,
        "train_seconds": t_train,
        "total_seconds": time.time() - t_start,
        **device_info(device),
    }
    (out / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"[train_tiny] done: {steps_done} steps in {t_train:.1f}s, checkpoint "
        f"{record['checkpoint_bytes']} bytes sha256 {record['checkpoint_sha256']}",
        flush=True,
    )
    return record


if __name__ == "__main__":
    main()
