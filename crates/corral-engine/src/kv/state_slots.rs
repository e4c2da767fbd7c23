//! `StateSlotPool`: which recurrent-state slots (hybrid models' conv and delta-rule state,
//! stored by the model's `RecurrentStateCache`) are free. A running sequence holds one slot;
//! the slot is returned when the sequence ends, is cancelled or is preempted.

use corral_model::SlotId;

/// Free list of state slots.
#[derive(Debug)]
pub struct StateSlotPool {
    free: Vec<SlotId>,
    total: usize,
}

impl StateSlotPool {
    /// `num_slots` free slots.
    pub fn new(num_slots: usize) -> Self {
        Self::range(0, num_slots)
    }

    /// Slots `first .. first + num_slots`, free (checkpoint slots follow the running ones).
    pub fn range(first: usize, num_slots: usize) -> Self {
        Self {
            free: (first as u32..(first + num_slots) as u32)
                .rev()
                .map(SlotId)
                .collect(),
            total: num_slots,
        }
    }

    /// A free slot, if any.
    pub fn acquire(&mut self) -> Option<SlotId> {
        self.free.pop()
    }

    /// Returns a slot.
    pub fn release(&mut self, slot: SlotId) {
        debug_assert!(!self.free.contains(&slot), "slot {} released twice", slot.0);
        self.free.push(slot);
    }

    /// Slots in all.
    pub fn capacity(&self) -> usize {
        self.total
    }

    /// Slots in use.
    pub fn num_used(&self) -> usize {
        self.total - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_come_back() {
        let mut pool = StateSlotPool::new(2);
        let a = pool.acquire().unwrap();
        let b = pool.acquire().unwrap();
        assert_ne!(a, b);
        assert!(pool.acquire().is_none());
        pool.release(a);
        assert_eq!(pool.acquire(), Some(a));
        assert_eq!(pool.num_used(), 2);
    }
}
