"""native_ext/pool.h: the one thread pool OpenBLAS's threaded jobs and Kiln's parallel kernels share.

Each check runs in a child process with a time limit, so a pool that deadlocks fails the test instead of
hanging the suite. The bytes of a product must not depend on whose threads computed it (OpenBLAS splits
the work itself), and the pool must keep working after a fork (Celery's prefork workers) and under
several Python threads at once (a serving thread beside a training one).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from native_ext import blas

CHILD_PRELUDE = textwrap.dedent("""
    import hashlib, json, os, sys, threading
    import numpy as np
    from native_ext import attention, blas

    def work(seed):
        rng = np.random.default_rng(seed)
        a = rng.standard_normal((700, 576), dtype=np.float32)
        w = rng.standard_normal((576, 1000), dtype=np.float32)
        q = rng.standard_normal((3, 600, 64), dtype=np.float32)
        k = rng.standard_normal((3, 200, 64), dtype=np.float32)
        out, lse = attention.forward(q, k, k, 0.125, 3, 32, threads=2)
        grads = attention.backward(out, q, k, k, out, lse, 0.125, 3, 32, threads=2)
        parts = [a @ w, a.T @ (a @ w), out, lse, *grads]
        return hashlib.sha256(b"".join(p.tobytes() for p in parts)).hexdigest()
""")


def run_child(body, env=None, timeout=120):
    code = CHILD_PRELUDE + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


needs_callback = pytest.mark.skipif(blas.THREAD_POOL != "kiln" and "KILN_OPENBLAS_THREADS" not in os.environ,
                                    reason=f"OpenBLAS's jobs do not run on Kiln's pool here: {blas.THREAD_POOL}")


@needs_callback
def test_products_are_the_same_bytes_on_either_pool():
    ours = run_child('print(json.dumps([blas.THREAD_POOL, blas.threads(), work(1), work(2)]))')
    theirs = run_child('print(json.dumps([blas.THREAD_POOL, blas.threads(), work(1), work(2)]))',
                       env={"KILN_OPENBLAS_THREADS": "own"})
    assert ours[0] == "kiln" and theirs[0].startswith("openblas")
    assert ours[2:] == theirs[2:]


@needs_callback
def test_a_forked_child_starts_the_pool_again():
    result = run_child("""
        before = work(3)
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(writer, work(3).encode())
            os._exit(0)
        os.close(writer)
        child = os.read(reader, 100).decode()
        _, status = os.waitpid(pid, 0)
        print(json.dumps([before, child, status, work(3)]))
    """)
    before, child, status, after = result
    assert status == 0
    assert child == before == after


@needs_callback
def test_several_python_threads_take_turns():
    result = run_child("""
        expected = [work(seed) for seed in range(4)]
        got = [None] * 8
        def run(i):
            got[i] = work(i % 4)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(json.dumps([expected, got]))
    """)
    expected, got = result
    assert got == expected * 2


def test_threads_follows_threadpool_limits():
    from threadpoolctl import threadpool_limits

    before = blas.threads()
    with threadpool_limits(1, user_api="blas"):
        assert blas.threads() == 1
    assert blas.threads() == before


def test_kiln_doctor_says_where_openblas_jobs_run(capsys):
    from kiln_web.cli import main

    main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["thread_pool"]["openblas_jobs"] == blas.THREAD_POOL
    assert report["thread_pool"]["threads"] == blas.threads()
    main(["doctor"])
    assert f"OpenBLAS's jobs run on {blas.THREAD_POOL}" in capsys.readouterr().out
