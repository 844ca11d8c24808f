// One decode forward through llama.cpp, timed the way mbd-rs's Model::bench_forward times its own: a W-token
// window at positions P..P+W-1 over a P-token KV cache, logits for every window row, the window removed from the
// cache again after each forward. Written for benches/llamacpp/quant_compare.py against the public llama.h API only.
//
//   mbd-llama-driver MODEL.gguf [--threads 2] [--cases 0:1,512:1,512:32] [--reps 5] [--warmup 1] [--fa 0|1]
//                               [--ctx 4096] [--batch 512] [--seed 0] [--last-logits] [--verbose]
//   --last-logits: the window asks for its last row's logits only (what a server computes for a prompt's new
//   tokens over a reused prefix before its first token), not every row's
//   mbd-llama-driver --bandwidth [--threads 2] [--gib 1] [--tries 5]
//
// Prints JSON lines on stdout: one {"kind":"model",...} after loading, then one {"kind":"case",...} per case
// (times in ms), or one {"kind":"bandwidth",...}. llama.cpp's own log goes to stderr (warnings and errors only
// unless --verbose).
#include "llama.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

[[noreturn]] void die(const std::string & msg) {
    std::fprintf(stderr, "mbd-llama-driver: %s\n", msg.c_str());
    std::exit(1);
}

std::string json_escape(const std::string & s) {
    std::string out;
    for (char c : s) {
        if (c == '"' || c == '\\') { out += '\\'; out += c; }
        else if (static_cast<unsigned char>(c) < 0x20) {
            char b[8];
            std::snprintf(b, sizeof b, "\\u%04x", c);
            out += b;
        } else out += c;
    }
    return out;
}

std::string json_list(const std::vector<double> & v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); i++) {
        char b[32];
        std::snprintf(b, sizeof b, "%s%.4f", i ? "," : "", v[i]);
        s += b;
    }
    return s + "]";
}

double median(std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

bool g_verbose = false;

void log_cb(enum ggml_log_level level, const char * text, void *) {
    if (g_verbose || level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// ---- read bandwidth: each thread sums its own slice of one buffer, all threads start together -----------------

uint64_t sum_slice(const uint64_t * p, size_t n) {
#if defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i *>(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i *>(p + i + 4)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i *>(p + i + 8)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i *>(p + i + 12)));
    }
    __m256i a = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i *>(lanes), a);
    uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; i++) s += p[i];
    return s;
#else
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) { s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3]; }
    for (; i < n; i++) s0 += p[i];
    return s0 + s1 + s2 + s3;
#endif
}

int run_bandwidth(int threads, double gib, int tries) {
    const size_t bytes = static_cast<size_t>(gib * (1ull << 30));
    const size_t n = bytes / sizeof(uint64_t);
    const size_t align = size_t(2) << 20;  // 2 MiB: lets the kernel back it with transparent huge pages
    auto * buf = static_cast<uint64_t *>(std::aligned_alloc(align, (n * sizeof(uint64_t) + align - 1) / align * align));
    if (!buf) die("out of memory");
    madvise(buf, n * sizeof(uint64_t), MADV_HUGEPAGE);  // best effort (THP "madvise" mode); fewer TLB misses
    const size_t per = (n / threads) & ~size_t(15);
    {   // first touch from the thread that will read the slice (page placement), and real data, not zero pages
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; t++)
            ts.emplace_back([=] {
                size_t lo = t * per, hi = t == threads - 1 ? n : lo + per;
                for (size_t i = lo; i < hi; i++) buf[i] = i * 0x9E3779B97F4A7C15ull;
            });
        for (auto & t : ts) t.join();
    }
    std::vector<double> gbs;
    uint64_t check = 0;
    for (int k = 0; k < tries; k++) {
        std::atomic<int> ready{0};
        std::atomic<bool> go{false};
        std::vector<uint64_t> sums(threads);
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; t++)
            ts.emplace_back([&, t] {
                size_t lo = t * per, hi = t == threads - 1 ? n : lo + per;
                ready++;
                while (!go.load(std::memory_order_acquire)) {}
                sums[t] = sum_slice(buf + lo, hi - lo);
            });
        while (ready.load() < threads) {}
        auto t0 = clock_type::now();
        go.store(true, std::memory_order_release);
        for (auto & t : ts) t.join();
        double s = ms_since(t0) / 1e3;
        for (auto v : sums) check += v;
        gbs.push_back(static_cast<double>(n * sizeof(uint64_t)) / s / 1e9);
    }
    std::free(buf);
    std::printf("{\"kind\":\"bandwidth\",\"threads\":%d,\"bytes\":%zu,\"tries\":%d,\"best_gbs\":%.3f,"
                "\"median_gbs\":%.3f,"
                "\"all_gbs\":%s,\"checksum\":%llu}\n",
                threads, n * sizeof(uint64_t), tries, *std::max_element(gbs.begin(), gbs.end()), median(gbs),
                json_list(gbs).c_str(), static_cast<unsigned long long>(check));
    return 0;
}

// ---- the forward benchmark -----------------------------------------------------------------------------------

struct Case { int prefix, window; };

std::vector<Case> parse_cases(const std::string & s) {
    std::vector<Case> out;
    size_t i = 0;
    while (i < s.size()) {
        size_t j = s.find(',', i);
        if (j == std::string::npos) j = s.size();
        std::string c = s.substr(i, j - i);
        size_t k = c.find(':');
        if (k == std::string::npos) die("case '" + c + "' is not P:W");
        out.push_back({std::atoi(c.substr(0, k).c_str()), std::atoi(c.substr(k + 1).c_str())});
        if (out.back().prefix < 0 || out.back().window < 1) die("bad case '" + c + "'");
        i = j + 1;
    }
    return out;
}

// positions [p0, p0 + n) of sequence 0; logits for every row when all_logits, else only for the last row
void fill_batch(llama_batch & b, const std::vector<llama_token> & ids, int p0, int n, bool all_logits) {
    b.n_tokens = n;
    for (int i = 0; i < n; i++) {
        b.token[i] = ids[p0 + i];
        b.pos[i] = p0 + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = all_logits || i == n - 1;
    }
}

void decode_or_die(llama_context * ctx, llama_batch & b, const char * what) {
    int rc = llama_decode(ctx, b);
    if (rc != 0) die(std::string("llama_decode failed (") + what + "), rc " + std::to_string(rc));
    llama_synchronize(ctx);
}

}  // namespace

int main(int argc, char ** argv) {
    std::string model_path, cases_arg = "0:1,512:1,512:4,512:16,512:32";
    int threads = 2, reps = 5, warmup = 1, fa = 0, n_ctx = 4096, n_batch = 512, tries = 5;
    unsigned seed = 0;
    double gib = 1.0;
    bool bandwidth = false, last_logits = false;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) die("missing value after " + a);
            return argv[++i];
        };
        if (a == "--threads" || a == "-t") threads = std::stoi(val());
        else if (a == "--cases") cases_arg = val();
        else if (a == "--reps") reps = std::stoi(val());
        else if (a == "--warmup") warmup = std::stoi(val());
        else if (a == "--fa") fa = std::stoi(val());
        else if (a == "--ctx") n_ctx = std::stoi(val());
        else if (a == "--batch") n_batch = std::stoi(val());
        else if (a == "--seed") seed = static_cast<unsigned>(std::stoul(val()));
        else if (a == "--bandwidth") bandwidth = true;
        else if (a == "--last-logits") last_logits = true;
        else if (a == "--gib") gib = std::stod(val());
        else if (a == "--tries") tries = std::stoi(val());
        else if (a == "--verbose" || a == "-v") g_verbose = true;
        else if (a == "-h" || a == "--help") {
            std::puts("mbd-llama-driver MODEL.gguf [--threads N] [--cases P:W,...] [--reps N] [--warmup N] [--fa 0|1]"
                      " [--ctx N] [--batch N] [--seed N] [--last-logits] [--verbose]\nmbd-llama-driver --bandwidth [--threads N]"
                      " [--gib G] [--tries N]");
            return 0;
        } else if (!a.empty() && a[0] == '-') die("unknown option " + a);
        else model_path = a;
    }
    if (threads < 1) die("--threads must be >= 1");
    if (bandwidth) return run_bandwidth(threads, gib, std::max(tries, 1));
    if (model_path.empty()) die("no model given (see --help)");
    std::vector<Case> cases = parse_cases(cases_arg);
    for (const Case & c : cases) {
        if (c.window > n_batch) die("window larger than --batch");
        if (c.prefix + c.window > n_ctx) die("prefix + window larger than --ctx");
    }

    llama_log_set(log_cb, nullptr);
    llama_backend_init();

    auto t_load = clock_type::now();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) die("cannot load " + model_path);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_batch;
    cp.n_ubatch = n_batch;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F16;
    cp.type_v = GGML_TYPE_F16;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("cannot create a context");
    double load_ms = ms_since(t_load);
    llama_memory_t mem = llama_get_memory(ctx);

    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    char desc[256];
    llama_model_desc(model, desc, sizeof desc);
    std::printf("{\"kind\":\"model\",\"path\":\"%s\",\"desc\":\"%s\",\"size_bytes\":%llu,\"n_params\":%llu,"
                "\"n_vocab\":%d,\"n_ctx\":%u,\"n_batch\":%u,\"threads\":%d,\"flash_attn\":%d,\"load_ms\":%.1f,"
                "\"system\":\"%s\"}\n",
                json_escape(model_path).c_str(), json_escape(desc).c_str(),
                static_cast<unsigned long long>(llama_model_size(model)),
                static_cast<unsigned long long>(llama_model_n_params(model)), n_vocab, llama_n_ctx(ctx),
                llama_n_batch(ctx), threads, fa, load_ms, json_escape(llama_print_system_info()).c_str());
    std::fflush(stdout);

    int max_tokens = 0;
    for (const Case & c : cases) max_tokens = std::max(max_tokens, c.prefix + c.window);
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> pick(0, n_vocab - 1);
    std::vector<llama_token> ids(max_tokens);
    for (auto & t : ids) t = pick(rng);

    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    for (const Case & c : cases) {
        llama_memory_clear(mem, true);
        auto t_fill = clock_type::now();
        for (int p = 0; p < c.prefix; p += n_batch) {  // the prefix, once, in n_batch chunks
            fill_batch(batch, ids, p, std::min(n_batch, c.prefix - p), false);
            decode_or_die(ctx, batch, "prefix");
        }
        double fill_ms = ms_since(t_fill);
        std::vector<double> times;
        for (int r = 0; r < warmup + reps; r++) {
            fill_batch(batch, ids, c.prefix, c.window, !last_logits);
            auto t0 = clock_type::now();
            decode_or_die(ctx, batch, "window");
            const float * logits = llama_get_logits_ith(ctx, c.window - 1);  // asked for with every row or alone
            double dt = ms_since(t0);
            if (!logits) die("no logits for the last window row");
            if (r >= warmup) times.push_back(dt);
            if (!llama_memory_seq_rm(mem, 0, c.prefix, -1)) {
                // a recurrent layer's state cannot drop positions (Qwen3.5's Gated DeltaNet): start again from
                // the prefix, untimed
                llama_memory_clear(mem, true);
                for (int p = 0; p < c.prefix; p += n_batch) {
                    fill_batch(batch, ids, p, std::min(n_batch, c.prefix - p), false);
                    decode_or_die(ctx, batch, "prefix");
                }
            }
        }
        std::printf("{\"kind\":\"case\",\"prefix\":%d,\"window\":%d,\"flash_attn\":%d,\"threads\":%d,\"reps\":%d,"
                    "\"warmup\":%d,\"last_logits\":%d,\"fill_ms\":%.3f,\"median_ms\":%.4f,\"min_ms\":%.4f,\"times_ms\":%s}\n",
                    c.prefix, c.window, fa, threads, reps, warmup, int(last_logits), fill_ms, median(times),
                    times.empty() ? 0.0 : *std::min_element(times.begin(), times.end()), json_list(times).c_str());
        std::fflush(stdout);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
