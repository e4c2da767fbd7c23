//! A step called from outside the pool runs on one of its threads, once, with a pool of one
//! thread too (no thread to keep busy): from outside, each of the step's parallel regions
//! would be sent to the pool and waited for. The global pool is set to one thread, so this
//! binary holds this one test.

use corral_backend::Device;
use corral_cpu::CpuBackend;

#[test]
fn a_step_runs_once_on_a_pool_of_one_thread() {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()
        .unwrap();
    let b = CpuBackend::new();
    let mut on_pool = Vec::new();
    b.run_step(&mut || on_pool.push(rayon::current_thread_index().is_some()));
    assert_eq!(on_pool, [true]);
}
