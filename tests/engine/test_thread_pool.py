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

from native_ext import blas, onednn

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
        print(json.dumps([before, child, status, work(3), blas.FLOAT32_GEMM]))
    """)
    before, child, status, after, gemm = result
    assert status == 0
    assert before == after
    if gemm == "openblas":
        assert child == before
    else:  # GNU OpenMP cannot compute in the child: it computes as a process on OpenBLAS would (no hang)
        assert child == run_child("print(json.dumps(work(3)))", env={"KILN_CPU_GEMM": "openblas"})


def test_the_float32_gemm_is_chosen_once_and_said():
    onednn_side = run_child("""
        from native_ext import onednn
        from trainer.runs.execution import blas_identity
        a = np.random.default_rng(0).standard_normal((300, 200), dtype=np.float32)
        c = np.empty((300, 300), np.float32)
        blas.gemm(c, a, a, trans_b=True)
        direct = np.empty_like(c)
        onednn.sgemm(direct, a, a, trans_b=True)
        print(json.dumps([blas.FLOAT32_GEMM, blas.GEMM_NOTE, blas.threads(), blas_identity(),
                          bool((c == direct).all()), bool((blas.matmul(a, a.T) == direct).all()),
                          bool(np.allclose(c, a @ a.T, rtol=1e-5, atol=1e-4))]))
    """, env={"KILN_CPU_GEMM": "auto"})
    gemm, note, threads, identity, equal, matmul_equal, close = onednn_side
    assert identity["float32_gemm"] == gemm
    if gemm == "onednn":
        assert note == "KILN_CPU_GEMM=auto" and equal and matmul_equal and close
        assert identity["onednn"]["version"] and identity["threads"] == threads
    openblas_side = run_child("""
        from trainer.runs.execution import blas_identity
        a = np.random.default_rng(0).standard_normal((300, 200), dtype=np.float32)
        c = np.empty((300, 300), np.float32)
        b = a.copy()  # numpy computes a @ a.T with ssyrk, whose bytes may differ from sgemm's (AMD Zen 5)
        blas.gemm(c, a, b, trans_b=True)
        print(json.dumps([blas.FLOAT32_GEMM, blas.GEMM_NOTE, blas_identity(), bool((c == a @ b.T).all())]))
    """, env={"KILN_CPU_GEMM": "openblas"})
    assert openblas_side[:2] == ["openblas", "KILN_CPU_GEMM=openblas"]
    assert openblas_side[2]["float32_gemm"] == "openblas" and "onednn" not in openblas_side[2]
    assert openblas_side[3]  # the same OpenBLAS call as numpy's matmul
    refused = subprocess.run([sys.executable, "-c", "import native_ext.blas"], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "KILN_CPU_GEMM": "mkl"})
    assert refused.returncode != 0 and "KILN_CPU_GEMM='mkl': use one of auto, onednn, openblas" in refused.stderr


def test_kernels_give_the_same_bytes_on_openmp_threads_and_on_the_pool():
    """With oneDNN computing the products, Kiln's kernels run on GNU OpenMP's threads (pool.h); their work is
    split by the caller, so the attention kernel's bytes are the pool's, at any thread count."""
    body = """
        rng = np.random.default_rng(5)
        q = rng.standard_normal((3, 600, 64), dtype=np.float32)
        k = rng.standard_normal((3, 200, 64), dtype=np.float32)
        out, lse = attention.forward(q, k, k, 0.125, 3, 32, threads=2)
        grads = attention.backward(out, q, k, k, out, lse, 0.125, 3, 32, threads=2)
        one = attention.forward(q, k, k, 0.125, 3, 32, threads=1)[0]
        digest = hashlib.sha256(b"".join(p.tobytes() for p in (out, lse, *grads))).hexdigest()
        print(json.dumps([blas.FLOAT32_GEMM, digest, bool((one == out).all())]))
    """
    openmp = run_child(body, env={"KILN_CPU_GEMM": "auto"})
    pool = run_child(body, env={"KILN_CPU_GEMM": "openblas"})
    assert pool[0] == "openblas" and pool[2] and openmp[2]
    assert openmp[1] == pool[1]


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
    with threadpool_limits(1):  # numpy's OpenBLAS and the OpenMP oneDNN computes on
        assert blas.threads() == 1
    assert blas.threads() == before


@pytest.mark.django_db  # kiln doctor reports the database too
def test_kiln_doctor_says_where_openblas_jobs_run(capsys):
    from kiln_web.cli import main

    main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["thread_pool"]["openblas_jobs"] == blas.THREAD_POOL
    assert report["thread_pool"]["threads"] == blas.threads()
    assert report["float32_gemm"] == {"library": blas.FLOAT32_GEMM, "why": blas.GEMM_NOTE}
    main(["doctor"])
    out = capsys.readouterr().out
    assert f"OpenBLAS's jobs run on {blas.THREAD_POOL}" in out
    assert f"products on {blas.FLOAT32_GEMM} ({blas.GEMM_NOTE};" in out


def test_openblas_num_threads_sizes_onednn_too():
    """Workers are told to set OPENBLAS_NUM_THREADS (docs/deployment.md): where oneDNN computes the products,
    its OpenMP threads follow it unless OMP_NUM_THREADS says otherwise, and the identity records that count."""
    body = """
        from trainer.runs.execution import blas_identity
        print(json.dumps([blas.FLOAT32_GEMM, blas.threads(), blas_identity()["threads"]]))
    """
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = CHILD_PRELUDE + textwrap.dedent(body)
    for threads in (1, 2):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                env={**env, "OPENBLAS_NUM_THREADS": str(threads)})
        assert result.returncode == 0, result.stderr
        gemm, engine_threads, recorded = json.loads(result.stdout.strip().splitlines()[-1])
        assert engine_threads == recorded == threads, gemm


def test_a_serving_thread_computes_on_openblas_whatever_the_process_does():
    """kiln_web.serving's completion threads call blas.serve_on_openblas: their products go to numpy's OpenBLAS
    (at the thread count it had before oneDNN held it at one) and their kernels to pool.h's pthreads, while the
    process's other threads keep computing where they did (and with the same bytes as before)."""
    result = run_child("""
        a = np.random.default_rng(1).standard_normal((300, 200), dtype=np.float32)
        def product():
            c = np.empty((300, 300), np.float32)
            blas.gemm(c, a, a, trans_b=True)
            return hashlib.sha256(c.tobytes()).hexdigest()
        before = product()
        seen = []
        def serve():
            blas.serve_on_openblas()
            seen.extend([blas.route() is None, product(), work(4), blas.threads()])
        thread = threading.Thread(target=serve)
        thread.start()
        thread.join()
        print(json.dumps([blas.FLOAT32_GEMM, before, product(), blas.route() is None, seen]))
    """)
    gemm, before, after, main_on_openblas, (served_on_openblas, served, kernels, threads) = result
    assert before == after and served_on_openblas and threads >= 1
    assert main_on_openblas == (gemm == "openblas")
    reference = run_child("""
        a = np.random.default_rng(1).standard_normal((300, 200), dtype=np.float32)
        c = np.empty((300, 300), np.float32)
        blas.gemm(c, a, a, trans_b=True)
        print(json.dumps([hashlib.sha256(c.tobytes()).hexdigest(), work(4)]))
    """, env={"KILN_CPU_GEMM": "openblas"})
    assert [served, kernels] == reference


needs_onednn = pytest.mark.skipif(onednn.float32_unavailable_reason() is not None,
                                  reason=f"oneDNN cannot compute here: {onednn.float32_unavailable_reason()}")


@needs_onednn
def test_the_bfloat16_scope_puts_a_threads_kernels_on_openmp_beside_its_products():
    """Inside blas.kernels_on_openmp (the bfloat16 scope: its products run on oneDNN's OpenMP threads, which spin
    after each product), the calling thread's kernels run on those OpenMP threads too, on as many as oneDNN
    computes with: in a serving thread (whose kernels are on the pthreads otherwise) and in a process whose
    float32 products are on OpenBLAS alike. The choice is the thread's own, undone on leaving, and the bytes
    are those of the pthreads."""
    body = """
        from native_ext import _attention as pool, onednn
        seen = {}
        def here():  # read, then put back
            choice = pool.choose_here(pool.HERE_PTHREADS)
            pool.choose_here(choice)
            return choice
        def serve():
            blas.serve_on_openblas()
            seen["before"] = here()
            with blas.kernels_on_openmp(), blas.routed(onednn.sgemm):
                seen["inside"], seen["threads"], seen["other"] = here(), blas.threads(), []
                other = threading.Thread(target=lambda: seen["other"].append(here()))
                other.start()
                other.join()
                seen["bytes"] = work(4)
            seen["after"] = here()
        thread = threading.Thread(target=serve)
        thread.start()
        thread.join()
        print(json.dumps([blas.FLOAT32_GEMM, onednn.compute_threads(), seen, work(4)]))
    """
    for env in ({}, {"KILN_CPU_GEMM": "openblas"}):
        gemm, onednn_threads, seen, outside = run_child(body, env=env)
        pthreads = 0 if gemm == "openblas" else 1  # serve_on_openblas is a no-op where OpenBLAS computes anyway
        assert [seen["before"], seen["inside"], seen["after"]] == [pthreads, 2, pthreads], (env, seen)
        assert seen["other"] == [0] and seen["threads"] == onednn_threads >= 1
        assert seen["bytes"] == outside


@pytest.mark.skipif(onednn.unavailable_reason() is not None,
                    reason=f"the bfloat16 route cannot run here: {onednn.unavailable_reason()}")
def test_bf16_computing_is_a_kernels_on_openmp_scope():
    from native_ext import _attention as pool
    from native_ext import bf16

    def here():
        choice = pool.choose_here(pool.HERE_PTHREADS)
        pool.choose_here(choice)
        return choice

    before = here()
    with bf16.computing():
        assert here() == pool.HERE_OPENMP
    assert here() == before


@pytest.mark.skipif(blas.FLOAT32_GEMM != "onednn",
                    reason=f"oneDNN does not compute the products here: {blas.GEMM_NOTE}")
def test_the_identity_records_the_isa_onednn_computes_with():
    """ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) caps the instructions oneDNN's kernels use, and the same product then
    has other bytes: a worker started with it must not resume a checkpoint written without it, so the execution
    identity records the ISA oneDNN computes with."""
    body = """
        from trainer.runs.execution import compute_execution_identity
        a = np.random.default_rng(1).standard_normal((256, 576), dtype=np.float32)
        w = np.random.default_rng(2).standard_normal((576, 1536), dtype=np.float32)
        c = np.empty((256, 1536), np.float32)
        blas.gemm(c, a, w)
        print(json.dumps([hashlib.sha256(c.tobytes()).hexdigest(), compute_execution_identity("cpu")]))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    results = []
    for extra in ({}, {"ONEDNN_MAX_CPU_ISA": "SSE41"}):
        result = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(body)], capture_output=True,
                                text=True, timeout=120, env={**env, **extra})
        assert result.returncode == 0, result.stderr
        results.append(json.loads(result.stdout.strip().splitlines()[-1]))
    (full, full_identity), (capped, capped_identity) = results
    assert full != capped  # the cap changes the bytes of a product
    assert full_identity != capped_identity
    assert full_identity["blas"]["onednn"]["cpu_isa"] != capped_identity["blas"]["onednn"]["cpu_isa"]
    assert capped_identity["blas"]["onednn"]["cpu_isa"] == "sse41"
