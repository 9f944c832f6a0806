// The CPU allocation meter (cpu_meter.h states what it counts and its invariants).
#include "meter/cpu_meter.h"

#include <atomic>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include "common/check.h"

namespace bagualu2::meter {
namespace {

// What precedes each allocation's data: its size and account. As wide as torch's CPU alignment
// (64 bytes), so the data after it is aligned as alloc_cpu aligns what it returns.
struct alignas(64) Header {
    std::int64_t size;
    std::int32_t account;
};
constexpr std::size_t kHeader = sizeof(Header);
static_assert(kHeader == 64);

struct Account {
    std::atomic<std::int64_t> bytes{0};
    std::atomic<std::int64_t> marks[kMarks] = {};
};

Account g_accounts[kAccounts];
std::atomic<int> g_charged{0};
std::atomic<bool> g_installed{false};

void raise_mark(std::atomic<std::int64_t>& mark, std::int64_t value) {
    std::int64_t seen = mark.load(std::memory_order_relaxed);
    while (seen < value && !mark.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
}

void charge(int account, std::int64_t size) {
    Account& a = g_accounts[account];
    const std::int64_t now = a.bytes.fetch_add(size, std::memory_order_relaxed) + size;
    for (auto& mark : a.marks) raise_mark(mark, now);
}

void free_counted(void* data) {
    if (data == nullptr) return;
    auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
    g_accounts[header->account].bytes.fetch_sub(header->size, std::memory_order_relaxed);
    c10::free_cpu(header);
}

class CountingAllocator final : public c10::Allocator {
public:
    c10::DataPtr allocate(std::size_t n) override {
        const c10::Device cpu(c10::DeviceType::CPU);
        if (n == 0) return {nullptr, nullptr, &free_counted, cpu};
        auto* header = static_cast<Header*>(c10::alloc_cpu(n + kHeader));
        header->size = static_cast<std::int64_t>(n);
        header->account = g_charged.load(std::memory_order_relaxed);
        charge(header->account, header->size);
        void* data = reinterpret_cast<char*>(header) + kHeader;
        return {data, data, &free_counted, cpu};
    }
    c10::DeleterFnPtr raw_deleter() const override { return &free_counted; }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
        default_copy_data(dest, src, count);
    }
};

CountingAllocator g_allocator;

void check_account(int account) {
    BAGUALU2_CHECK(account >= 0 && account < kAccounts, "account ", account, " is not one of 0..", kAccounts - 1);
}

void check_mark(int mark) { BAGUALU2_CHECK(mark >= 0 && mark < kMarks, "mark ", mark, " is not 0 or 1"); }

}  // namespace

void install() {
    if (g_installed.exchange(true)) return;
    // Above the default allocator's registration (priority 0), so no later registration at that
    // priority takes the CPU back.
    c10::SetCPUAllocator(&g_allocator, /*priority=*/1);
}

bool installed() { return g_installed.load(); }

int charge_to(int account) {
    check_account(account);
    return g_charged.exchange(account);
}

std::int64_t bytes(int account) {
    check_account(account);
    return g_accounts[account].bytes.load(std::memory_order_relaxed);
}

std::int64_t high_water(int account, int mark) {
    check_account(account);
    check_mark(mark);
    return g_accounts[account].marks[mark].load(std::memory_order_relaxed);
}

std::int64_t reset_mark(int account, int mark) {
    check_account(account);
    check_mark(mark);
    Account& a = g_accounts[account];
    return a.marks[mark].exchange(a.bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace bagualu2::meter
