// The CPU allocation meter: what the CPU's tensors hold, counted as the allocator hands memory out,
// the way a GPU's caching allocator counts its own (torch's CPU allocator counts nothing).
//
// install() makes a counting allocator torch's CPU allocator for the rest of the process; every
// CPU storage allocated after it is counted, from its allocation to its free, at the bytes it
// asked for. Allocations are charged to an account (charge_to; account 0 until it is called),
// and a free is taken from the account its allocation was charged to, whichever is charged now:
// one process can meter several models in turn, each under its own account, and what one leaves
// alive and frees later (a graph collected late) never moves another's count.
//
// Invariants:
// - an account's bytes are the sum of the sizes of its storages alive now, never negative;
// - each of an account's two high-water marks is at least its bytes, and at least every value
//   its bytes took since that mark was last reset (reset_mark sets it to the bytes now);
// - memory from the allocator is torch's own alloc_cpu with a header before the data: aligned as
//   torch aligns it, freed by one deleter whichever allocator is installed when it dies.
#pragma once

#include <cstdint>
#include <utility>

namespace bagualu2::meter {

constexpr int kAccounts = 64;
constexpr int kMarks = 2;

// Idempotent; never undone (storages it allocated still die through its deleter).
void install();
bool installed();

// The account later allocations are charged to; returns the one charged before. Error unless
// 0 <= account < kAccounts.
int charge_to(int account);

// An account's bytes alive now.
std::int64_t bytes(int account);
// An account's high-water mark `mark` (0 or 1) since it was last reset.
std::int64_t high_water(int account, int mark);
// Reset it to the account's bytes now; returns the value it had.
std::int64_t reset_mark(int account, int mark);

}  // namespace bagualu2::meter
