/* Binds the calling thread's OpenMP team one thread per CPU.
 *
 * Why: a prefill worker on all of a host's cores splits each product evenly between its
 * torch threads (oneDNN's static split), so a product ends when its slowest thread does.
 * Unbound, the scheduler often runs two of those threads on one CPU while a decode worker
 * runs on the other (sampled on two cores: both prefill threads on one CPU in about half
 * the samples), and the prefill goes at half a core. Bound one per CPU, they never stack.
 *
 * Built with -fopenmp, this library's needs resolve to the libgomp.so.1 that PyTorch
 * loaded, so the team is the one torch's products run on: libgomp keeps a thread's team
 * (its pool) from one parallel region to the next, and binding is a property of each
 * thread, so every later product from the same calling thread runs on the bound threads. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Team member i bound to cpus[i], for i from 1: the caller (member 0) is not, as it also
 * runs the few-row kernel, whose products split with a helper thread the scheduler wakes on
 * the caller's CPU; kept there for good, the caller made a 64-token bf16 prefill 1.5x slower
 * (61 -> 93 ms). It takes cpus[0] around oneDNN's products only (disagg.engine.threads,
 * on_the_teams_cpu). Returns how many members were bound (n - 1),
 * or -1 where the team did not get n threads (OMP_DYNAMIC, a thread limit): then some of
 * torch's threads would stay unbound. */
int omp_team_bind(const int *cpus, int n) {
    int bound = 0, size = 0;
#pragma omp parallel num_threads(n) reduction(+ : bound)
    {
        int me = omp_get_thread_num();
        if (me == 0) {
            size = omp_get_num_threads();
        } else {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[me], &set);
            bound += sched_setaffinity(0, sizeof set, &set) == 0; /* pid 0: this thread */
        }
    }
    return size == n ? bound : -1;
}

/* For tests: each member's thread id (tids[i]) and the one CPU it may run on (-1: several),
 * in a team of n started from the calling thread, as a product's would be. */
void omp_team_members(int n, long *tids, int *cpus) {
#pragma omp parallel num_threads(n)
    {
        int me = omp_get_thread_num();
        cpu_set_t set;
        tids[me] = syscall(SYS_gettid);
        cpus[me] = -1;
        if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) == 1)
            for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
                if (CPU_ISSET(cpu, &set))
                    cpus[me] = cpu;
    }
}
