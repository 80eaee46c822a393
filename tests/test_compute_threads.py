"""Where compute threads run: a prefill worker's torch threads bound one per CPU
(disagg/engine/cpu_kernels/omp_team.c), and a launched worker's lowered priority, of its
threads and of its scheduling group (local_cluster.lower_priority). Each runs in a
subprocess of its own: binding changes a process's threads for good."""

import os
import subprocess
import sys
import textwrap

import pytest

from disagg.engine.cpu_kernels import small_gemm

TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding one thread per CPU needs two CPUs")


def run_python(script: str, **popen) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120, **popen)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@TWO_CPUS
def test_torch_products_run_on_the_threads_bound_one_per_cpu():
    # A thread binds its team to two CPUs; torch's product from the same thread then runs on
    # exactly that team: no new thread appears, and the bound second one does the work.
    out = run_python("""
        import os, threading, torch
        torch.set_num_threads(2)
        from disagg.engine.cpu_kernels import omp_team

        def cpu_ticks(tid):
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])

        def device_thread():
            cpus = sorted(os.sched_getaffinity(0))[:2]
            os.sched_setaffinity(0, cpus)  # this thread, as --device-cpus would
            assert omp_team.bind(cpus)
            members = omp_team.members(2)
            assert [cpu for _, cpu in members] == [-1, cpus[1]], members  # the caller stays free
            helper = members[1][0]
            threads, before = set(os.listdir("/proc/self/task")), cpu_ticks(helper)
            a = torch.randn(1024, 1024)
            for _ in range(40):
                a @ a
            assert set(os.listdir("/proc/self/task")) == threads, "torch started threads of its own"
            assert omp_team.members(2) == members
            print("helper ticks", cpu_ticks(helper) - before)

        thread = threading.Thread(target=device_thread)
        thread.start()
        thread.join()
    """)
    assert out.startswith("helper ticks ") and int(out.split()[-1]) > 0, out


@TWO_CPUS
def test_the_prefill_workers_compute_threads_are_bound_only_with_a_thread_per_cpu():
    out = run_python("""
        import os, threading, torch
        from disagg.engine.threads import on_the_teams_cpu, start_compute_thread
        from disagg.engine.cpu_kernels import omp_team

        def on_a_thread(threads, cpus, bind):
            torch.set_num_threads(threads)
            seen = []
            def run():
                start_compute_thread(cpus, bind)
                free = os.sched_getaffinity(0)
                with on_the_teams_cpu():  # around oneDNN's products: the caller on the CPU its team leaves
                    inside = os.sched_getaffinity(0)
                assert os.sched_getaffinity(0) == free
                seen.append([min(inside) if len(inside) == 1 and inside != free else -1] + [cpu for _, cpu in omp_team.members(threads)][1:])
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
            return seen[0]

        two = frozenset(sorted(os.sched_getaffinity(0))[:2])
        print(on_a_thread(2, two, True), on_a_thread(3, two, True), on_a_thread(2, two, False), on_a_thread(2, frozenset([min(two)]), True), sep="|")
    """)
    bound, too_many, off, pinned_to_one = out.split("|")
    low, high = sorted(os.sched_getaffinity(0))[:2]
    assert bound == f"[{low}, {high}]"  # the team's thread on the second CPU, the caller on the first around oneDNN's products
    assert too_many == "[-1, -1, -1]"  # more threads than CPUs: none bound, the caller left as it was
    assert off == "[-1, -1]"  # --no-bind-compute-threads
    assert pinned_to_one == f"[-1, {low}]"  # --device-cpus one CPU: pinned there, as before, not bound one per CPU


@TWO_CPUS
@pytest.mark.skipif(small_gemm.kernel() is None, reason="no AVX2 CPU or C compiler: the few-row kernel is not built here")
def test_a_thread_whose_first_product_is_inside_on_the_teams_cpu_still_shares_its_products_across_two_cores():
    """The few-row kernel decides once per thread whether its products use two cores, and gives its helper the
    CPUs of the thread that first shares one. A prefill worker whose first prompt is long (transformers' modules,
    inside on_the_teams_cpu, the caller on one CPU) must settle both from the thread's own CPUs: else every later
    prefill's products stay on one core, or the helper sits on the caller's CPU."""
    out = run_python("""
        import os, threading, time, torch
        from disagg.engine.threads import on_the_teams_cpu, start_compute_thread
        from disagg.engine.cpu_kernels import small_gemm

        kernel = small_gemm.kernel(torch.float32)
        torch.set_num_threads(2)
        panels = kernel.pack(torch.randn(24 * 64, 576))  # shared: over SPLIT_MIN_BYTES
        seen = []
        def run():
            cpus = sorted(os.sched_getaffinity(0))[:2]
            start_compute_thread(frozenset(cpus), True)
            with on_the_teams_cpu():
                pinned = sorted(os.sched_getaffinity(0))
                kernel.product(torch.randn(1, 576), panels, 24 * 64, None)  # the thread's first product
            deadline = time.monotonic() + 30  # the helper takes its CPUs as it takes a job: poll, not sleep
            while sorted(kernel.helper_cpus()) != cpus and time.monotonic() < deadline:
                kernel.product(torch.randn(1, 576), panels, 24 * 64, None)
            seen.append((len(pinned), kernel.splits_here(), sorted(kernel.helper_cpus()) == cpus))
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        print(seen)
    """)
    assert out == "[(1, True, True)]", out


def test_a_lowered_priority_covers_the_threads_and_the_scheduling_group():
    from disagg.tools.local_cluster import AUTOGROUP, lower_priority

    group = f"open({AUTOGROUP!r}).read().strip() if os.path.exists({AUTOGROUP!r}) else 'no autogroup'"
    probe = f"import os; print(os.getpriority(os.PRIO_PROCESS, 0)); print({group})"
    before = os.getpriority(os.PRIO_PROCESS, 0)
    niceness, group = run_python(probe, start_new_session=True, preexec_fn=lambda: lower_priority(7)).splitlines()
    assert int(niceness) == min(19, before + 7)
    if group != "no autogroup":  # Linux without CONFIG_SCHED_AUTOGROUP: the threads' niceness alone
        assert group.endswith(" nice 7"), group
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # only the child
