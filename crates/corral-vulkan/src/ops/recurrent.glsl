// What the recurrent ops share: their runs, U32 [runs, 4] of `[start, len, slot, fresh]`,
// read and checked against the batch and the state pool, and the first of the `len - 1`
// consecutive slots that keep a run's state after each of its tokens but the last.

// A run's `kept` entry when its intermediate states are not kept (NO_KEPT_STATES).
const uint NO_KEPT = 0xffffffffu;

struct Run {
    uint start;
    uint len;
    uint slot;
    bool fresh;
    // The first slot keeping its states after each token but the last, or NO_KEPT.
    uint kept;
};

// Run `r` of `runs` and its kept slots from `kept` (address 0: none kept). False where the
// run lies beyond the batch of `tokens`, its slot or kept slots beyond the `slots` of the
// pool (or its own slot among the kept ones), or it is longer than the `longest` promised:
// the invocation that is `reporter` reports the fault, and every one skips the run.
bool run_of(uint64_t runs, uint64_t kept, uint r, uint tokens, uint slots, uint longest,
            Fault fault, bool reporter, out Run run) {
    Uints words = Uints(runs + uint64_t(r) * 16);
    run.start = words.v[0];
    run.len = words.v[1];
    run.slot = words.v[2];
    run.fresh = words.v[3] != 0;
    run.kept = kept != 0 && run.len > 1 ? Uints(kept).v[r] : NO_KEPT;
    uint code = 0;
    if (run.slot >= slots || run.start > tokens || run.len > tokens - run.start) {
        code = FAULT_RECURRENT_RUN;
    } else if (run.kept != NO_KEPT
               && (run.kept >= slots || run.len - 1 > slots - run.kept
                   || (run.slot >= run.kept && run.slot - run.kept < run.len - 1))) {
        code = FAULT_RECURRENT_RUN;
    } else if (run.len > longest) {
        code = FAULT_RUN_LENGTH;
    }
    if (code != 0 && reporter) {
        report(fault, code);
    }
    return code == 0;
}
