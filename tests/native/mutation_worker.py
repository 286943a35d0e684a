"""Loads mutated copies of a zipmoe GGUF with zipmoe's llama.cpp and classifies what each load + generate did.

Used by tests/native/test_mutation.py and tests/native/test_hardening.py; also runnable by hand for longer
campaigns (see below for a sanitizer build):

    LLAMA_CPP_LIB_PATH=build/bin python tests/native/mutation_worker.py JOB.json

With a sanitizer build of llama.cpp (-DZIPMOE_SANITIZE=ON -DZIPMOE_LLAMA=ON), point LLAMA_CPP_LIB_PATH at its bin
and preload the runtime (LD_PRELOAD=$(cc -print-file-name=libasan.so), ASAN_OPTIONS=detect_leaks=0): a sanitizer
report aborts the child, which counts as a crash.

JOB.json: {"model": path, "mutations": [[kind, offset, arg], ...], "workdir": dir, "timeout": seconds}
(or {"reference": path, "files": [paths], "env": {...}}: given damaged files, each against the reference)
with kind "flip" (xor byte at offset with arg), "set" (byte at offset := arg), "zero" (arg bytes from offset
:= 0) or "trunc" (the file cut to offset bytes). Prints one JSON line: the reference result of the unmutated
file and, per mutation, its outcome:

    ok       loaded, and every logit and generated token is bit-identical to the reference
    refused  llama.cpp or zipmoe refused it: a load error, or an error from llama_decode
    wrong    loaded and produced output that differs from the reference (silently wrong: a failure)
    crash    the child died of a signal (a failure)
    hang     the child did not finish within the timeout (a failure)

Each load runs in a child forked from this process (llama_cpp is imported once, before any thread exists),
under an address-space limit so that a file declaring absurd sizes cannot take the machine's memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import select
import signal
import sys
import time

PROMPT = b"the expert model said hello to the world of water and time"
N_GEN = 4
N_CTX = 64
MEMORY_LIMIT = 8 << 30  # bytes of address space for one child


def _evaluate(path: str) -> dict:
    import numpy as np
    from llama_cpp import Llama

    try:
        llm = Llama(model_path=path, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, logits_all=True, seed=0,
                    verbose=True)  # llama.cpp's log goes to the child's stderr: a file, read for the reason
    except Exception as e:  # noqa: BLE001 - any Python exception is a clean refusal
        return {"outcome": "refused", "stage": "load", "error": f"{type(e).__name__}: {e}"}
    try:
        tokens = llm.tokenize(PROMPT)
        llm.eval(tokens)
        generated = []
        for _ in range(N_GEN):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(nxt)
            llm.eval([nxt])
        scores = np.ascontiguousarray(llm.scores[: llm.n_tokens], dtype=np.float32)
        return {"outcome": "loaded", "tokens": [int(t) for t in tokens], "generated": generated,
                "logits_sha256": hashlib.sha256(scores.tobytes()).hexdigest()}
    except Exception as e:  # noqa: BLE001
        return {"outcome": "refused", "stage": "decode", "error": f"{type(e).__name__}: {e}"}
    finally:
        llm.close()


def _reason(log_path: str) -> str:
    """The last line of a child's llama.cpp log that says why it failed."""
    try:
        lines = open(log_path, errors="replace").read().splitlines()
    except OSError:
        return ""
    keys = ("zipmoe", "error", "failed", "invalid", "exception")
    info = ("- kv", "match their checksums", "stored compressed", "no memory budget", "cache tiers")  # load notes
    found = [ln.strip() for ln in lines if any(k in ln.lower() for k in keys) and not any(i in ln for i in info)]
    zipmoe = [ln for ln in found if "zipmoe:" in ln]
    return (zipmoe or found or [""])[0][:300]


def run_child(path: str, timeout: float) -> dict:
    """Evaluates `path` in a forked child; classifies signals and timeouts."""
    log_path = path + ".log"
    res = _run_child(path, timeout, log_path)
    if res["outcome"] == "refused":
        res["reason"] = _reason(log_path)
    if os.path.exists(log_path):
        os.unlink(log_path)
    return res


def _run_child(path: str, timeout: float, log_path: str) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(r)
            if "asan" not in os.environ.get("LD_PRELOAD", ""):  # ASan's shadow memory needs the address space
                resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)  # llama.cpp's own messages
            os.dup2(log, 2)
            res = _evaluate(path)
            os.write(w, json.dumps(res).encode())
        except BaseException:  # noqa: BLE001
            code = 70
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return {"outcome": "hang"}
        data = os.read(r, 1 << 16)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"outcome": "crash", "signal": os.WTERMSIG(status)}
    if not chunks:
        return {"outcome": "crash", "exit": os.WEXITSTATUS(status)}
    return json.loads(b"".join(chunks))


def mutate(data: bytes, kind: str, offset: int, arg: int) -> bytes:
    b = bytearray(data)
    if kind == "flip":
        b[offset] ^= arg
    elif kind == "set":
        b[offset] = arg
    elif kind == "zero":
        b[offset:offset + arg] = bytes(len(b[offset:offset + arg]))
    elif kind == "trunc":
        del b[offset:]
    else:
        raise ValueError(kind)
    return bytes(b)


def classify(res: dict, ref: dict) -> str:
    if res["outcome"] != "loaded":
        return res["outcome"]
    same = all(res[k] == ref[k] for k in ("tokens", "generated", "logits_sha256"))
    return "ok" if same else "wrong"


def run_files(job: dict) -> None:
    """{"reference": path, "files": [paths], "env": {name: value}}: each file's outcome against the reference's."""
    os.environ.update(job.get("env", {}))
    timeout = job.get("timeout", 60)
    ref = run_child(job["reference"], timeout)
    out = []
    for path in job["files"]:
        res = run_child(path, timeout)
        out.append({"file": path, "class": classify(res, ref) if ref["outcome"] == "loaded" else res["outcome"],
                    "stage": res.get("stage"), "error": res.get("error", "")[:300], "reason": res.get("reason", ""),
                    "signal": res.get("signal")})
    print(json.dumps({"reference": ref, "results": out}))


def main(job_path: str) -> None:
    import llama_cpp  # noqa: F401 - once, here, so that every forked child has it loaded
    import numpy  # noqa: F401

    job = json.loads(open(job_path).read())
    if "files" in job:
        return run_files(job)
    model, workdir, timeout = job["model"], job["workdir"], job.get("timeout", 60)
    ref = run_child(model, timeout)
    if ref["outcome"] != "loaded":
        raise SystemExit(f"the unmutated model does not run: {ref}")
    data = open(model, "rb").read()
    target = os.path.join(workdir, f"mutated-{os.getpid()}.gguf")
    results = []
    for kind, offset, arg in job["mutations"]:
        with open(target, "wb") as f:
            f.write(mutate(data, kind, offset, arg))
        res = run_child(target, timeout)
        results.append({"mutation": [kind, offset, arg], "class": classify(res, ref),
                        "stage": res.get("stage"), "error": res.get("error", "")[:300],
                        "reason": res.get("reason", ""),
                        "signal": res.get("signal")})
    os.unlink(target)
    print(json.dumps({"reference": ref, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1])
