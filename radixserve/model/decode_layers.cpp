// A step's decoder layers in one call: every layer of a Llama-family model over the step's
// rows (a decode step's one-token rows; or a mixed step's, or an extend batch's, new tokens
// after their cached prefixes), through the same kernels, in the same order, on the same
// buffers' values as the Python model calls them one by one (cpu_kernels.py: the blocked or
// row linear kernels, fused_ops.cpp, the decode- and extend-attention kernels; torch's own
// BLAS sgemm where the Python layers call F.linear), so the
// hidden states come out bit for bit as they do there. What it saves is what lies between
// the kernels: ~10 Python calls, ctypes conversions and torch allocations per layer
// (SmolLM2: 30 layers, ~300 calls a step). Built and loaded by cpu_kernels.py; it calls the
// other kernels through the function pointers decode_layers.py hands it, so it has no
// instructions of its own beyond a copy (the new tokens' K/V into the pool).
#include <stdint.h>
#include <string.h>

namespace {

using LinearChunked = void (*)(const void* x, const void* w, const void* bias, void* out, int64_t m,
                               int64_t n, int64_t k, int threads, int64_t chunk);
using LinearRows = void (*)(const void* x, const void* w, const void* bias, void* out, int64_t m,
                            int64_t n, int64_t k, int threads);
using LinearOneRow = void (*)(const void* x, const void* w, const void* bias, void* out, int64_t n,
                              int64_t k, int threads);
using RmsNorm = void (*)(const void* x, const void* w, void* out, int64_t rows, int64_t dim,
                         float eps, int threads);
using AddRmsNorm = void (*)(const void* x, const void* delta, const void* w, void* sum, void* out,
                            int64_t rows, int64_t dim, float eps, int threads);
using Rotary = void (*)(void* q, void* k, const void* cos, const void* sin, int64_t tokens,
                        int64_t heads, int64_t kv_heads, int64_t dim, int threads);
using SiluMul = void (*)(const void* gate, const void* up, void* out, int64_t rows, int64_t width,
                         int64_t stride, int threads);
using DecodeAttention = void (*)(const void* q, const void* k_pool, const void* v_pool,
                                 const int64_t* table, const int64_t* rows,
                                 const int64_t* seq_lens, void* out, int64_t batch, int64_t heads,
                                 int64_t kv_heads, int64_t dim, int64_t table_stride, float scale,
                                 int threads, int kv_dtype, int64_t window);
using LoraAdd = void (*)(const void* x, int64_t rows, int64_t in, const int64_t* site,
                         void* const* outs, const int64_t* strides, const int64_t* row_owner,
                         int threads);
using ExtendAttention = void (*)(const void* q, const void* k_pool, const void* v_pool,
                                 const int64_t* table, const int64_t* rows,
                                 const int64_t* prefix_lens, const int64_t* extend_lens, void* out,
                                 int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                 int64_t table_stride, float scale, int threads, int dtype);

// BLAS's sgemm (Fortran interface): the one torch's fp32 F.linear reaches on CPU (MKL's,
// inside libtorch_cpu), C = alpha op(A) op(B) + beta C, column-major, 32-bit sizes
using Sgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

// A linear layer's entry in a layer's row (decode_layers.py LINEAR_FIELDS): the kernel, the
// weight (its layout), the bias or 0, and how the kernel is called.
struct Linear {
    int64_t fn, weight, bias, kind;
};
constexpr int64_t kOneRow = -2;  // fp32_gemv: (x, w, bias, out, n, k, threads)
constexpr int64_t kRows = -1;    // (x, w, bias, out, m, n, k, threads)
// as kRows, a gate/up kernel whose out is silu(gate) * up (n: its width, half the weight's)
constexpr int64_t kActRows = -3;
// fn: torch's sgemm (Sgemm), the weight torch's own (n, k), no bias: the call torch's
// F.linear makes for x (m, k) @ w.T (out^T = w x^T in BLAS's column-major terms), with
// BLAS's threads (torch sets them with its own)
constexpr int64_t kTorchGemm = -4;
// kind >= 0: a chunked kernel (fp32_linear.cpp), kind its chunk of columns

void linear(const Linear& l, const void* x, void* out, int64_t m, int64_t n, int64_t k,
            int threads) {
    const void *w = (const void*)l.weight, *bias = (const void*)l.bias;
    if (l.kind == kOneRow) {
        ((LinearOneRow)l.fn)(x, w, bias, out, n, k, threads);
    } else if (l.kind == kTorchGemm) {
        const int rows = (int)m, features = (int)n, columns = (int)k;
        const float one = 1.0f, zero = 0.0f;
        ((Sgemm)l.fn)("T", "N", &features, &rows, &columns, &one, (const float*)w, &columns,
                      (const float*)x, &columns, &zero, (float*)out, &features);
    } else if (l.kind == kRows || l.kind == kActRows) {
        ((LinearRows)l.fn)(x, w, bias, out, m, n, k, threads);
    } else {
        ((LinearChunked)l.fn)(x, w, bias, out, m, n, k, threads, l.kind);
    }
}

// A layer's row (decode_layers.py LAYER_FIELDS): its norms' weights, its pool's K and V
// tensors, its per-head q and k norms' weights (Qwen3's; 0 where it has none), then its six
// linear layers.
struct Layer {
    int64_t input_norm, post_norm, k_pool, v_pool, q_norm, k_norm;
    Linear q, k, v, o, gate_up, down;
};
static_assert(sizeof(Layer) == 30 * sizeof(int64_t), "decode_layers.py LAYER_FIELDS");

// The step's shapes and the kernels shared by every layer (decode_layers.py STEP_FIELDS).
struct Step {
    int64_t rms_norm, add_rms_norm, rotary, silu_mul, lora_add;
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, elem_size, threads,
        table_stride;
};
static_assert(sizeof(Step) == 14 * sizeof(int64_t), "decode_layers.py STEP_FIELDS");

// A layer's LoRA sites for the step's adapters (decode_layers.py LORA_LAYER_FIELDS): qkv, o,
// gate_up, down, each fused_ops.cpp's LoraSite (16 fields; its A 0 where the layer has none).
constexpr int64_t kLoraSiteFields = 16;
enum LoraSiteIndex { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

// A stretch of the step's rows attended by one kernel call, as the Python attention backend
// makes it (attention.py driver_view; decode_layers.py SEGMENT_FIELDS): the decode kernel
// over one-token rows (lens: their sequence lengths), or the extend kernel over requests'
// new tokens (lens: their cached prefixes' lengths, extend_lens: their new tokens').
struct Segment {
    int64_t kind, fn, start, batch, req_rows, lens, extend_lens, code;
};
static_assert(sizeof(Segment) == 8 * sizeof(int64_t), "decode_layers.py SEGMENT_FIELDS");
constexpr int64_t kDecode = 0, kExtend = 1;

// The last layer narrowed to the step's logits rows (decode_layers.py CUT_FIELDS; the
// Python layers' `last`): past its K/V, every row of which goes to the pool, it runs only
// `rows` (increasing indices into the step's rows), as the narrowed batch's rows: their
// queries rotated by cos/sin (their own rows of the tables), attended by `segments` (the
// narrowed batch's kernel calls), their products through `layer` (the last layer's fields
// for that many rows, as the Python layers choose them).
struct Cut {
    int64_t rows, count, cos, sin, layer, segments, num_segments;
};
static_assert(sizeof(Cut) == 7 * sizeof(int64_t), "decode_layers.py CUT_FIELDS");

char* at(void* base, int64_t elements, int64_t elem_size) {
    return (char*)base + elements * elem_size;
}

// Each of `rows` rows' heads of `x` (rows, heads * dim) normed in place by the per-head norm
// of weights w, where the layer has one (as the Python attention norms q.view(-1, H, D)).
void head_norm(const Step& s, int64_t w, void* x, int64_t rows, int64_t heads, float eps) {
    if (w == 0 || rows * heads == 0) return;
    ((RmsNorm)s.rms_norm)(x, (const void*)w, x, rows * heads, s.head_dim, eps, (int)s.threads);
}

// The step's adapters' products for one site of a layer added onto outs (up to 3 modules,
// rows `stride` elements apart each), where the step has adapters (lora: that layer's
// sites) and the layer has that site.
void add_lora(const Step& s, const int64_t* lora, int site, const int64_t* row_owner,
              const void* x, int64_t rows, int64_t in, void* o0, void* o1, void* o2,
              int64_t s0, int64_t s1, int64_t s2) {
    if (lora == nullptr) return;
    const int64_t* fields = lora + site * kLoraSiteFields;
    if (fields[0] == 0) return;
    void* outs[3] = {o0, o1, o2};
    const int64_t strides[3] = {s0, s1, s2};
    ((LoraAdd)s.lora_add)(x, rows, in, fields, outs, strides, row_owner, (int)s.threads);
}

}  // namespace

extern "C" {

// x (rows, hidden): the embeddings in, the residual stream before the last layer's MLP out;
// delta (rows, hidden): that MLP's output (the caller adds the two, as the Python model
// does). cos, sin (rows, head_dim): the rows' rotary tables; slots (rows,): where each row's
// K/V go in every layer's pool; table: the request→token table; segments: the attention
// kernels' calls, in the rows' order, that cover every row (no sliding window). cut_fields:
// a Cut, or null (the last layer runs every row); with one, x and delta come out for the
// cut's rows alone, in their first rows. scratch: rows * (hidden + 2 * heads * head_dim + 2
// * kv_heads * head_dim + 3 * intermediate) elements. lora_fields: per layer its LoRA sites
// for the step's adapters, or null (no adapter rows; then row_owner is null too); row_owner:
// each row's adapter in their stack, or null where every row uses one adapter. A step with
// adapters has no cut, and its gate/up kernels are plain (kRows) ones.
void decode_layers(const int64_t* step_fields, const int64_t* layer_fields, int64_t num_layers,
                   void* x, void* delta, const void* cos, const void* sin, const int64_t* slots,
                   const int64_t* table, const int64_t* segment_fields, int64_t num_segments,
                   const int64_t* cut_fields, void* scratch, float eps, float scale,
                   const int64_t* lora_fields, const int64_t* row_owner) {
    const Step& s = *(const Step*)step_fields;
    const Layer* layers = (const Layer*)layer_fields;
    const Cut* cut = (const Cut*)cut_fields;
    const int64_t m = s.rows, es = s.elem_size, hidden = s.hidden, inter = s.intermediate;
    const int64_t q_width = s.heads * s.head_dim, kv_width = s.kv_heads * s.head_dim;
    const int threads = (int)s.threads;
    char* h = (char*)scratch;  // the norm's output, each sub-layer's input
    char* q = at(h, m * hidden, es);
    char* k = at(q, m * q_width, es);
    char* v = at(k, m * kv_width, es);
    char* attn = at(v, m * kv_width, es);
    char* gate_up = at(attn, m * q_width, es);
    char* act = at(gate_up, m * 2 * inter, es);
    for (int64_t i = 0; i < num_layers; i++) {
        const Layer& l = layers[i];
        const int64_t* lora =
            lora_fields == nullptr ? nullptr : lora_fields + i * 4 * kLoraSiteFields;
        const bool narrow = cut != nullptr && i == num_layers - 1;
        if (i == 0)
            ((RmsNorm)s.rms_norm)(x, (const void*)l.input_norm, h, m, hidden, eps, threads);
        else
            ((AddRmsNorm)s.add_rms_norm)(x, delta, (const void*)l.input_norm, x, h, m, hidden,
                                         eps, threads);
        if (!narrow) linear(l.q, h, q, m, q_width, hidden, threads);
        linear(l.k, h, k, m, kv_width, hidden, threads);
        linear(l.v, h, v, m, kv_width, hidden, threads);
        add_lora(s, lora, kQkv, row_owner, h, m, hidden, q, k, v, q_width, kv_width, kv_width);
        head_norm(s, l.q_norm, q, narrow ? 0 : m, s.heads, eps);
        head_norm(s, l.k_norm, k, m, s.kv_heads, eps);
        ((Rotary)s.rotary)(q, k, cos, sin, m, narrow ? 0 : s.heads, s.kv_heads, s.head_dim,
                           threads);
        const int64_t row_bytes = kv_width * es;
        for (int64_t t = 0; t < m; t++) {
            memcpy((char*)l.k_pool + slots[t] * row_bytes, k + t * row_bytes, row_bytes);
            memcpy((char*)l.v_pool + slots[t] * row_bytes, v + t * row_bytes, row_bytes);
        }
        // the rest of the layer: every row, or the cut's rows moved to the front
        int64_t n = m;
        const Layer* p = &l;
        const Segment* segments = (const Segment*)segment_fields;
        int64_t count = num_segments;
        if (narrow) {
            const int64_t* keep = (const int64_t*)cut->rows;
            n = cut->count, p = (const Layer*)cut->layer;
            segments = (const Segment*)cut->segments, count = cut->num_segments;
            for (int64_t t = 0; t < n; t++) {
                if (keep[t] == t) continue;  // increasing: row keep[t] > t is not yet moved
                memcpy(at(h, t * hidden, es), at(h, keep[t] * hidden, es), hidden * es);
                memcpy(at(x, t * hidden, es), at(x, keep[t] * hidden, es), hidden * es);
            }
            linear(p->q, h, q, n, q_width, hidden, threads);
            head_norm(s, p->q_norm, q, n, s.heads, eps);
            ((Rotary)s.rotary)(q, k, (const void*)cut->cos, (const void*)cut->sin, n, s.heads, 0,
                               s.head_dim, threads);
        }
        for (int64_t j = 0; j < count; j++) {
            const Segment& g = segments[j];
            const void* q_g = at(q, g.start * q_width, es);
            void* out_g = at(attn, g.start * q_width, es);
            if (g.kind == kDecode)
                ((DecodeAttention)g.fn)(q_g, (const void*)l.k_pool, (const void*)l.v_pool, table,
                                        (const int64_t*)g.req_rows, (const int64_t*)g.lens, out_g,
                                        g.batch, s.heads, s.kv_heads, s.head_dim, s.table_stride,
                                        scale, threads, (int)g.code, 0);
            else
                ((ExtendAttention)g.fn)(q_g, (const void*)l.k_pool, (const void*)l.v_pool, table,
                                        (const int64_t*)g.req_rows, (const int64_t*)g.lens,
                                        (const int64_t*)g.extend_lens, out_g, g.batch, s.heads,
                                        s.kv_heads, s.head_dim, s.table_stride, scale, threads,
                                        (int)g.code);
        }
        linear(p->o, attn, delta, n, hidden, q_width, threads);
        add_lora(s, lora, kO, row_owner, attn, n, q_width, delta, nullptr, nullptr, hidden, 0, 0);
        ((AddRmsNorm)s.add_rms_norm)(x, delta, (const void*)l.post_norm, x, h, n, hidden, eps,
                                     threads);
        if (p->gate_up.kind == kActRows) {
            linear(p->gate_up, h, act, n, inter, hidden, threads);
        } else if (p->gate_up.kind == kTorchGemm) {
            // as the Python MLP takes a product of these rows to torch (GatedMLP._local):
            // gate and up each their half of the weight's product, one after the other
            // (never with adapters: decode_layers.py gives no kTorchGemm to such a step)
            Linear half = p->gate_up;
            char* up = at(gate_up, n * inter, es);
            linear(half, h, gate_up, n, inter, hidden, threads);
            half.weight = (int64_t)at((char*)half.weight, inter * hidden, es);
            linear(half, h, up, n, inter, hidden, threads);
            ((SiluMul)s.silu_mul)(gate_up, up, act, n, inter, inter, threads);
        } else {
            linear(p->gate_up, h, gate_up, n, 2 * inter, hidden, threads);
            add_lora(s, lora, kGateUp, row_owner, h, n, hidden, gate_up, at(gate_up, inter, es),
                     nullptr, 2 * inter, 2 * inter, 0);
            ((SiluMul)s.silu_mul)(gate_up, at(gate_up, inter, es), act, n, inter, 2 * inter,
                                  threads);
        }
        linear(p->down, act, delta, n, hidden, inter, threads);
        add_lora(s, lora, kDown, row_owner, act, n, inter, delta, nullptr, nullptr, hidden, 0, 0);
    }
}

}  // extern "C"
