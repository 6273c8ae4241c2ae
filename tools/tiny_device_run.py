"""One GPU call for `metrale-tiny-code`: size, train (twice per configuration), evaluate, pack.

Owns the device-side orchestration of issue 6, so one lent-GPU command yields the checkpoint,
its validation figure and a reproduction of that figure:

  1. environment and corpus statistics (hash of the device's stdlib);
  2. a throughput benchmark with as many concurrent processes as the training phase will run
     (random tokens); it fixes `--max-steps` = budget / measured step time, so every run has
     a fixed step count decided before it starts;
  3. for each configuration in CONFIGS, two identical runs of tools/train_tiny.py (same
     seed, same command) in parallel on the one GPU;
  4. tools/eval_tiny.py on every checkpoint (validation, dev, train sample);
  5. a summary (the configuration to ship is the one with the lower mean DEV bits per byte;
     the validation set is not used to choose), and the files to bring back under --out:
     one model.safetensors per configuration (replica a), one tokenizer.json, and a tarball
     of every small file (configs, records, eval JSONs, logs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

# name -> train_tiny.py flags (everything else at its default)
CONFIGS: dict[str, list[str]] = {
    "d00e10": ["--dropout", "0.0", "--epochs", "10"],
    "d10e20": ["--dropout", "0.1", "--epochs", "20"],
    "d20e30": ["--dropout", "0.2", "--epochs", "30"],
}
COMMON = [
    "--seed",
    "1234",
    "--batch-size",
    "32",
    "--seq-len",
    "1024",
    "--log-every",
    "25",
    "--eval-every",
    "100",
]


def log(msg: str) -> None:
    print(f"[device_run {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except Exception as e:  # environment probing only
        return f"{cmd[0]}: {e}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/tiny_work")
    p.add_argument("--train-budget-s", type=float, default=270.0)
    p.add_argument("--deadline-s", type=float, default=500.0, help="kill trainers after this")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--stdlib", default=None, help="stdlib root (default: this interpreter's)")
    p.add_argument("--extra-train", default="", help="smoke runs: extra train_tiny.py flags")
    p.add_argument("--extra-eval", default="", help="smoke runs: extra eval_tiny.py flags")
    args = p.parse_args()
    extra_train = args.extra_train.split() + (["--stdlib", args.stdlib] if args.stdlib else [])
    extra_eval = args.extra_eval.split() + (["--stdlib", args.stdlib] if args.stdlib else [])
    t0 = time.time()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    py = sys.executable
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", RAYON_NUM_THREADS="2", TOKENIZERS_PARALLELISM="true"
    )
    configs = args.configs.split(",")
    nproc = 2 * len(configs)

    try:
        log(sh(["nvidia-smi", "-L"]).strip())
        import tiny_corpus as tc

        stats = tc.build_corpus(args.stdlib).stats()
        (work / "corpus_stats.json").write_text(json.dumps(stats, indent=1))
        log(
            f"python {sys.version.split()[0]} corpus {json.dumps({k: stats[k] for k in ('stdlib_root', 'corpus_sha256', 'train', 'dev', 'validation')})}"
        )

        # 2. benchmark with nproc concurrent processes
        bench_cmd = [
            py,
            str(TOOLS / "train_tiny.py"),
            "--bench-steps",
            "20",
            "--dropout",
            "0.1",
            *COMMON,
            *extra_train,
            "--bench-barrier",
            str(work / "bench_barrier"),
            "--bench-nproc",
            str(nproc),
        ]
        procs = [
            subprocess.Popen(
                bench_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            for _ in range(nproc)
        ]
        step_s = []
        for pr in procs:
            try:
                text, _ = pr.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                pr.kill()
                text, _ = pr.communicate()
            (work / "bench.log").open("a").write(text)
            for line in text.splitlines():
                if line.startswith("BENCH "):
                    step_s.append(json.loads(line[6:])["step_s"])
        if not step_s:
            log("benchmark failed:\n" + (work / "bench.log").read_text()[-3000:])
            pack(out, work, configs, {})
            sys.exit(1)
        worst = max(step_s)
        max_steps = int(args.train_budget_s / worst)
        log(
            f"bench: {nproc} concurrent, step {min(step_s) * 1e3:.0f}-{worst * 1e3:.0f} ms -> --max-steps {max_steps}"
        )

        # 3. training: two identical runs per configuration
        runs: dict[str, subprocess.Popen] = {}
        logs = {}
        for c in configs:
            for rep in ("a", "b"):
                name = f"{c}_{rep}"
                cmd = [
                    py,
                    "tools/train_tiny.py",
                    "--out",
                    str(work / name),
                    *COMMON,
                    *CONFIGS[c],
                    "--max-steps",
                    str(max_steps),
                    "--max-train-seconds",
                    str(args.train_budget_s * 1.3),
                    "--tag",
                    c,
                    *extra_train,
                ]
                logs[name] = (work / f"{name}.log").open("w")
                runs[name] = subprocess.Popen(
                    cmd, stdout=logs[name], stderr=subprocess.STDOUT, env=env, cwd=str(TOOLS.parent)
                )
        log(f"started {len(runs)} training runs")
        while any(r.poll() is None for r in runs.values()):
            if time.time() - t0 > args.deadline_s:
                log("DEADLINE: killing remaining training runs")
                for r in runs.values():
                    if r.poll() is None:
                        r.kill()
                break
            time.sleep(5)
        for name, r in runs.items():
            log(
                f"{name}: rc {r.wait()}; "
                + (work / f"{name}.log").read_text().strip().splitlines()[-1][:200]
            )

        # 4. evaluation
        evals = {}
        for name in runs:
            if (work / name / "model.safetensors").exists():
                evals[name] = subprocess.Popen(
                    [
                        py,
                        "tools/eval_tiny.py",
                        str(work / name),
                        "--out",
                        str(work / name / "eval.json"),
                        *extra_eval,
                    ],
                    stdout=(work / f"{name}.eval.log").open("w"),
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=str(TOOLS.parent),
                )
        for _name, e in evals.items():
            try:
                e.wait(timeout=max(30.0, 560 - (time.time() - t0) - 20))
            except subprocess.TimeoutExpired:
                e.kill()

        # 5. summary
        summary: dict[str, dict] = {}
        for name in runs:
            ev = work / name / "eval.json"
            rec = work / name / "training_record.json"
            if not ev.exists() or not rec.exists():
                continue
            e = json.loads(ev.read_text())
            r = json.loads(rec.read_text())
            summary[name] = {
                "val_bpb": e["validation"]["bits_per_byte"],
                "dev_bpb": e["dev"]["bits_per_byte"],
                "train_bpb": e["train_sample"]["bits_per_byte"],
                "mtp_top1_t2_val": e["validation"]["mtp_top1_accuracy_t2"],
                "steps": r["steps_done"],
                "epochs": r["epochs"],
                "train_s": r["train_seconds"],
                "stopped_early": r["stopped_early_by_safety_net"],
                "ckpt_sha": r["checkpoint_sha256"][:12],
                "tok_sha": r["tokenizer_sha256"][:12],
            }
        best = None
        means = {}
        for c in configs:
            pair = [summary.get(f"{c}_{rep}") for rep in ("a", "b")]
            if all(pair):
                means[c] = sum(x["dev_bpb"] for x in pair) / 2
        if means:
            best = min(means, key=means.get)
        result = {
            "max_steps": max_steps,
            "bench_step_s": step_s,
            "runs": summary,
            "dev_mean": means,
            "chosen": best,
            "wall_s": time.time() - t0,
        }
        (work / "summary.json").write_text(json.dumps(result, indent=1))
        for name, s in summary.items():
            log(
                f"{name}: "
                + " ".join(
                    f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()
                )
            )
        log(f"chosen (lowest mean dev bpb): {best}; wall {time.time() - t0:.0f}s")
        pack(out, work, configs, summary)
    except BaseException:
        import traceback

        traceback.print_exc()
        pack(out, work, configs, {})
        raise


def pack(out: Path, work: Path, configs: list[str], summary: dict) -> None:
    for c in configs:
        m = work / f"{c}_a" / "model.safetensors"
        if m.exists():
            shutil.copy(m, out / f"{c}.model.safetensors")
    for c in configs:
        t = work / f"{c}_a" / "tokenizer.json"
        if t.exists():
            shutil.copy(t, out / "tokenizer.json")
            break
    with tarfile.open(out / "records.tar.gz", "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            if f.is_file() and f.name not in ("model.safetensors", "tokenizer.json"):
                tar.add(f, arcname=str(f.relative_to(work)))


if __name__ == "__main__":
    main()
