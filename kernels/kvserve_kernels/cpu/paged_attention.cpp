// Paged attention with the eviction statistics in the same pass, on CPU, over kvserve's page lists.
//
// A "row" is one page list (a (request, KV head) of one layer): tables[r] holds its page ids in list order and
// lengths[r] its entries. Its Q queries are the newest entries' queries, oldest first: query i sits at list index
// lengths[r] - Q + i and attends causally to entries 0 .. that index. For every query and each of its G query heads
// the kernel computes the logits to every visible entry once and, from them:
//   - the attention output (sum of p * value), unless a logit gain is given (then the probabilities are a policy's
//     statistic, not attention);
//   - the probabilities summed over the row's queries and heads, per entry (H2O / EMS column sums, TOVA's and
//     SnapKV's window sums, AhaKV's with its per-query gain);
//   - each query head's logit to entry 0 (MAT), before the gain.
//
// Pages are in vLLM 0.32's CPU cache formats, read in place: "vec" (a page is [D, bs] keys, transposed, then
// [bs, D] values) and "amx" (keys [bs/16, D/2, 16, 2], values [D/16, bs/2, 16, 2]), in float32 or bfloat16. With
// keys as [D, bs] a tile's logits are D rank-1 updates of [bs] accumulators (no horizontal sums), and with values as
// [bs, D] the outputs are bs rank-1 updates of [D] ones: the "vec" format is multiplied where it lies (bf16 widened to
// float32 in registers), an "amx" page is first decoded into those two float32 blocks. The products and the softmax
// run on 16-lane vectors (GCC vector types, which -O3 -march=native lowers to AVX-512, AVX2 or SSE for the machine),
// and a block of up to 8 query rows shares each loaded key or value vector. Work is split over (row, query tile)
// units with ATen's thread pool; each thread sums probabilities into its own buffer, added up at the end, so no
// unit waits on another. Scratch buffers are per thread and reused: nothing is allocated per row or per page.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kVec = 0;
constexpr int64_t kAmx = 1;
constexpr int64_t kTile = 16;        // AMX tile rows: tokens (keys) or dimensions (values)
// query rows up to which a "vec" page is multiplied where it lies; more rows widen each element once into float32
// first (a prefill tile), instead of once per block of rows
constexpr int64_t kDecodeRows = 8;
constexpr int64_t kQueryTile = 16;   // queries per unit: a decoded page is reused by tile * G query rows

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline float to_float(float value) { return value; }
inline float to_float(c10::BFloat16 value) { return bf16_to_float(value.x); }

// exp(x) for x <= 0 (a logit minus its row maximum), as Cephes' expf: range reduction by ln 2 split in two parts,
// a degree-5 polynomial, the power of two built in the exponent bits (`exp_approx` below, 16 lanes at once).
// Relative error about 1e-7; inputs below -87 are clamped (exp(-87) ~ 1.6e-38, zero to float32 sums).

// One half of a page as float32 [rows, cols]: its keys as [D, bs], its values as [bs, D]. "vec" stores each half
// so; "amx" as [cols / 16 tiles][rows / 2 row pairs][16 columns][2 pair members] (keys: 16-token tiles of dimension
// pairs; values: 16-dimension tiles of token pairs).
template <typename T>
void decode_half(const T* half, int64_t layout, int64_t rows, int64_t cols, float* out) {
  if (layout == kVec) {
    for (int64_t i = 0; i < rows * cols; ++i) out[i] = to_float(half[i]);
    return;
  }
  for (int64_t tile = 0; tile < cols / kTile; ++tile)
    for (int64_t pair = 0; pair < rows / 2; ++pair) {
      const T* src = half + (tile * (rows / 2) + pair) * 2 * kTile;
      float* even = out + (2 * pair) * cols + tile * kTile;
      float* odd = even + cols;
      for (int64_t i = 0; i < kTile; ++i) {
        even[i] = to_float(src[2 * i]);
        odd[i] = to_float(src[2 * i + 1]);
      }
    }
}

// 16 float32 lanes: GCC lowers each operation to one AVX-512 instruction, two AVX2 ones, or four SSE ones.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
typedef uint16_t u16x16 __attribute__((vector_size(32)));
inline f32x16 load(const c10::BFloat16* p) {  // 16 bf16 widened in registers: bf16 is float32's upper half
  u16x16 half;
  std::memcpy(&half, p, sizeof(half));
  const i32x16 wide = __builtin_convertvector(half, i32x16) << 16;
  return reinterpret_cast<const f32x16&>(wide);
}

inline f32x16 exp_approx(f32x16 x) {  // exp_approx above, 16 lanes at once; x <= 0
  const f32x16 floor_value = x - x - 87.0f;
  x = x < floor_value ? floor_value : x;
  const f32x16 whole = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, i32x16),
                                               f32x16);  // round to nearest (x <= 0: truncation rounds up)
  const f32x16 r = x - whole * 0.693359375f + whole * 2.12194440e-4f;
  f32x16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x16 exponent = (__builtin_convertvector(whole, i32x16) + 127) << 23;
  return p * reinterpret_cast<const f32x16&>(exponent);
}

// Accumulator vectors one block keeps in registers: AVX-512 has 32 vector registers (24 for the block, the rest
// for the loaded vectors of b); with AVX2 a 16-lane vector takes two of its 16.
#ifdef __AVX512F__
constexpr int kAccumulators = 24;
#else
constexpr int kAccumulators = 6;
#endif

// dst[m, 0 .. n) (m < rows, row stride dst_stride) = sum over k < depth of a[m, k] * b[k, 0 .. n), with a's rows
// `a_stride` apart and b's `b_stride`; n a multiple of 16. A block of Rows x Cols accumulator vectors stays in
// registers over the whole depth: each loaded vector of b serves Rows rows of a, and the Rows * Cols independent
// chains keep the FMA units busy instead of waiting on one chain's latency. With `accumulate` dst is added to
// instead of overwritten.
template <int Rows, int Cols, typename B>
inline void block_product(const float* a, int64_t a_stride, const B* b, int64_t b_stride, int64_t depth,
                          float* dst, int64_t dst_stride, bool accumulate) {
  f32x16 acc[Rows][Cols];
  for (int i = 0; i < Rows; ++i)
    for (int c = 0; c < Cols; ++c)
      acc[i][c] = accumulate ? load(dst + i * dst_stride + c * kLanes) : f32x16{};
  for (int64_t k = 0; k < depth; ++k) {
    f32x16 column[Cols];
    for (int c = 0; c < Cols; ++c) column[c] = load(b + k * b_stride + c * kLanes);
    for (int i = 0; i < Rows; ++i) {
      const float scalar = a[i * a_stride + k];
      for (int c = 0; c < Cols; ++c) acc[i][c] += scalar * column[c];
    }
  }
  for (int i = 0; i < Rows; ++i)
    for (int c = 0; c < Cols; ++c) store(dst + i * dst_stride + c * kLanes, acc[i][c]);
}

// The last `rows` (< Rows) rows of a column block, as one block of exactly that many rows.
template <int Rows, int Cols, typename B>
inline void remaining_rows(int64_t rows, const float* a, int64_t a_stride, const B* b, int64_t b_stride,
                           int64_t depth, float* dst, int64_t dst_stride, bool accumulate) {
  if constexpr (Rows > 0) {
    if (rows == Rows)
      block_product<Rows, Cols>(a, a_stride, b, b_stride, depth, dst, dst_stride, accumulate);
    else
      remaining_rows<Rows - 1, Cols>(rows, a, a_stride, b, b_stride, depth, dst, dst_stride, accumulate);
  }
}

// Columns [0, 16 * Cols) of dst for every row, Rows rows at a time.
template <int Cols, typename B>
inline void column_block(const float* a, int64_t a_stride, const B* b, int64_t b_stride, int64_t depth, int64_t rows,
                         float* dst, int64_t dst_stride, bool accumulate) {
  constexpr int Rows = std::max(1, std::min(8, kAccumulators / Cols));
  int64_t m = 0;
  for (; m + Rows <= rows; m += Rows)
    block_product<Rows, Cols>(a + m * a_stride, a_stride, b, b_stride, depth, dst + m * dst_stride, dst_stride,
                              accumulate);
  remaining_rows<Rows - 1, Cols>(rows - m, a + m * a_stride, a_stride, b, b_stride, depth, dst + m * dst_stride,
                                 dst_stride, accumulate);
}

template <typename B>  // b: float32, or bf16 read straight from the cache
void product(const float* a, int64_t a_stride, const B* b, int64_t b_stride, int64_t depth, int64_t n,
             int64_t rows, float* dst, int64_t dst_stride, bool accumulate) {
  int64_t col = 0;
  for (; col + 4 * kLanes <= n; col += 4 * kLanes)
    column_block<4>(a, a_stride, b + col, b_stride, depth, rows, dst + col, dst_stride, accumulate);
  for (; col + 2 * kLanes <= n; col += 2 * kLanes)
    column_block<2>(a, a_stride, b + col, b_stride, depth, rows, dst + col, dst_stride, accumulate);
  for (; col < n; col += kLanes)
    column_block<1>(a, a_stride, b + col, b_stride, depth, rows, dst + col, dst_stride, accumulate);
}

// Softmax of logits[0 .. limit) in place (entries set to -inf are hidden), zero from limit to `padded` (a multiple
// of 16): the row then holds probabilities.
void softmax_row(float* logits, int64_t limit, int64_t padded) {
  for (int64_t j = limit; j < padded; ++j) logits[j] = -INFINITY;
  f32x16 peak_lanes = load(logits);
  for (int64_t j = kLanes; j < padded; j += kLanes) {
    const f32x16 v = load(logits + j);
    peak_lanes = v > peak_lanes ? v : peak_lanes;
  }
  float peak = peak_lanes[0];
  for (int i = 1; i < kLanes; ++i) peak = std::max(peak, peak_lanes[i]);
  f32x16 total_lanes{};
  for (int64_t j = 0; j < padded; j += kLanes) {
    const f32x16 logit = load(logits + j);
    f32x16 e = exp_approx(logit - peak);
    // hidden lanes (-inf: past the limit, or masked) would come out as exp(-87): make them exactly zero
    e = logit == -INFINITY ? f32x16{} : e;
    store(logits + j, e);
    total_lanes += e;
  }
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += total_lanes[i];
  const float inverse = 1.0f / total;
  for (int64_t j = 0; j < padded; j += kLanes) store(logits + j, load(logits + j) * inverse);
}

// Attention-Gate's visibility (arXiv:2410.12876, Eq. 4/7): a query sees its own entry and the earlier ones that
// are valid for the row's KV head, or within `recent` positions before it. Absent (valid == nullptr): plain causal.
struct Mask {
  const bool* valid = nullptr;          // [R, width_mask]
  const int64_t* key_positions = nullptr;  // [R, width_mask]
  const int64_t* query_positions = nullptr;  // [R, Q]
  int64_t width = 0;
  int64_t recent = 0;
};

struct Scratch {
  std::vector<float> queries;  // [M, D] the unit's query rows, float32, times the scale
  std::vector<float> logits;   // [M, pages * bs] logits, then probabilities (zero past each row's limit)
  std::vector<float> outputs;  // [M, D]
  std::vector<float> keys;     // [D, bs] one decoded page
  std::vector<float> values;   // [bs, D]
  std::vector<int64_t> limits; // [M] visible entries of each query row
};

template <typename Q, typename T>  // the queries' (and output's) element type, the cache's
void run(const at::Tensor& query, const at::Tensor& pages, int64_t layout, const at::Tensor& tables,
         const at::Tensor& lengths, double scale, const c10::optional<at::Tensor>& gain, const Mask& mask,
         bool want_output, bool want_sums, bool want_first, at::Tensor& output, at::Tensor& sums, at::Tensor& first) {
  const int64_t rows = query.size(0), num_queries = query.size(1), group = query.size(2), dim = query.size(3);
  const int64_t bs = pages.size(2);
  const int64_t page_elems = bs * 2 * dim;
  const int64_t width = want_sums ? sums.size(1) : 0;
  const int64_t table_width = tables.size(1);
  const Q* query_data = query.data_ptr<Q>();
  const T* page_data = pages.data_ptr<T>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  const float* gain_data = gain.has_value() ? gain->data_ptr<float>() : nullptr;
  Q* out_data = want_output ? output.data_ptr<Q>() : nullptr;
  float* first_data = want_first ? first.data_ptr<float>() : nullptr;
  const float scale_f = static_cast<float>(scale);

  const int64_t tiles = (num_queries + kQueryTile - 1) / kQueryTile;
  const int64_t units = rows * tiles;
  const int threads = at::get_num_threads();
  // per thread: its own probability sums [rows, width], added into `sums` at the end
  std::vector<std::vector<float>> thread_sums(want_sums ? threads : 0);

  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    const int thread = at::get_thread_num();
    static thread_local Scratch s;  // reused across units and calls: nothing allocated per row or page
    float* row_sums_base = nullptr;
    if (want_sums) {
      auto& mine = thread_sums[thread];
      if (mine.empty()) mine.assign(rows * width, 0.0f);
      row_sums_base = mine.data();
    }
    s.keys.resize(dim * bs);
    s.values.resize(bs * dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t row = unit / tiles, tile = unit % tiles;
      const int64_t length = length_data[row];
      const int64_t q_begin = tile * kQueryTile, q_end = std::min(num_queries, q_begin + kQueryTile);
      const int64_t m_rows = (q_end - q_begin) * group;
      const int64_t visible = length - num_queries + q_end;  // entries the tile's newest query sees
      if (visible <= 0) continue;
      const int64_t num_pages = (visible + bs - 1) / bs;
      TORCH_CHECK(num_pages <= table_width, "kvserve paged_attention: row ", row, " needs ", num_pages,
                  " pages, its table holds ", table_width);
      const int64_t stride = num_pages * bs;
      s.queries.resize(m_rows * dim);
      s.logits.resize(m_rows * stride);
      s.limits.resize(m_rows);
      for (int64_t m = 0; m < m_rows; ++m) {
        const int64_t q = q_begin + m / group, g = m % group;
        const Q* src = query_data + ((row * num_queries + q) * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) s.queries[m * dim + d] = to_float(src[d]) * scale_f;
        s.limits[m] = length - num_queries + q + 1;
      }
      const int64_t* table = table_data + row * table_width;
      // logits, page by page: [M, D] queries times the page's [D, bs] keys
      for (int64_t p = 0; p < num_pages; ++p) {
        const T* page = page_data + table[p] * page_elems;
        if (layout == kVec && m_rows <= kDecodeRows) {  // keys stored [D, bs]: multiplied where they lie
          product(s.queries.data(), dim, page, bs, dim, bs, m_rows, s.logits.data() + p * bs, stride, false);
        } else {
          decode_half(page, layout, dim, bs, s.keys.data());
          product(s.queries.data(), dim, s.keys.data(), bs, dim, bs, m_rows, s.logits.data() + p * bs, stride, false);
        }
      }
      float* row_sums = want_sums ? row_sums_base + row * width : nullptr;
      for (int64_t m = 0; m < m_rows; ++m) {
        const int64_t q = q_begin + m / group, g = m % group;
        float* logit = s.logits.data() + m * stride;
        const int64_t limit = s.limits[m];
        if (want_first) first_data[(row * num_queries + q) * group + g] = logit[0];
        if (mask.valid != nullptr) {
          const bool* valid = mask.valid + row * mask.width;
          const int64_t* key_positions = mask.key_positions + row * mask.width;
          const int64_t position = mask.query_positions[row * num_queries + q];
          for (int64_t j = 0; j + 1 < limit; ++j)  // the last visible entry is the query's own
            if (!valid[j] && key_positions[j] < position - mask.recent) logit[j] = -INFINITY;
        }
        if (gain_data != nullptr) {
          const float factor = gain_data[row * num_queries + q];
          for (int64_t j = 0; j < limit; ++j) logit[j] *= factor;
        }
        softmax_row(logit, limit, stride);
        if (row_sums != nullptr) {
          const int64_t upto = std::min(limit, width);
          for (int64_t j = 0; j < upto; ++j) row_sums[j] += logit[j];
        }
      }
      if (!want_output) continue;
      // outputs, page by page: [M, bs] probabilities times the page's [bs, D] values, accumulated
      s.outputs.assign(m_rows * dim, 0.0f);
      for (int64_t p = 0; p < num_pages; ++p) {
        const T* page = page_data + table[p] * page_elems + bs * dim;
        float* probs = s.logits.data() + p * bs;
        if (layout == kVec && m_rows <= kDecodeRows) {  // values stored [bs, D]
          product(probs, stride, page, dim, bs, dim, m_rows, s.outputs.data(), dim, true);
        } else {
          decode_half(page, layout, bs, dim, s.values.data());
          product(probs, stride, s.values.data(), dim, bs, dim, m_rows, s.outputs.data(), dim, true);
        }
      }
      for (int64_t m = 0; m < m_rows; ++m) {
        const int64_t q = q_begin + m / group, g = m % group;
        Q* dst = out_data + ((row * num_queries + q) * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<Q>(s.outputs[m * dim + d]);
      }
    }
  });
  if (want_sums) {
    float* total = sums.data_ptr<float>();
    for (const auto& mine : thread_sums) {
      if (mine.empty()) continue;
      for (int64_t i = 0; i < rows * width; ++i) total[i] += mine[i];
    }
  }
}

// query [R, Q, G, D] (float32, or the cache's dtype); pages [P, 1, bs, 2D]; tables [R, W] int64;
// lengths [R] int64; gain [R, Q] float32 or none. Returns (output [R, Q, G, D] or empty, sums [R, width] float32
// or empty, first [R, Q * G] float32 or empty); `width` is the longest row's length.
std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_attention(const at::Tensor& query, const at::Tensor& pages,
                                                               int64_t layout, const at::Tensor& tables,
                                                               const at::Tensor& lengths, double scale,
                                                               const c10::optional<at::Tensor>& gain,
                                                               const c10::optional<at::Tensor>& valid,
                                                               const c10::optional<at::Tensor>& key_positions,
                                                               const c10::optional<at::Tensor>& query_positions,
                                                               int64_t recent, bool want_output, bool want_sums,
                                                               bool want_first) {
  TORCH_CHECK(query.dim() == 4 && query.is_contiguous(), "query must be a contiguous [R, Q, G, D] tensor");
  TORCH_CHECK(pages.dim() == 4 && pages.size(1) == 1 && pages.is_contiguous(),
              "pages must be the contiguous [P, 1, block_size, 2 * D] page view");
  TORCH_CHECK(pages.scalar_type() == at::kFloat || pages.scalar_type() == at::kBFloat16,
              "paged_attention reads float32 or bfloat16 caches");
  TORCH_CHECK(query.scalar_type() == pages.scalar_type() || query.scalar_type() == at::kFloat,
              "queries must be float32 or the cache's dtype");
  TORCH_CHECK(pages.size(3) == 2 * query.size(3), "pages hold 2 * D elements per slot");
  TORCH_CHECK(layout == kVec || layout == kAmx, "layout must be 0 (vec) or 1 (amx)");
  TORCH_CHECK(pages.size(2) % kTile == 0 && query.size(3) % kTile == 0,
              "paged_attention needs block and head sizes divisible by 16");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 &&
                  tables.size(0) == query.size(0),
              "tables must be a contiguous int64 [R, W] tensor");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == query.size(0),
              "lengths must be a contiguous int64 [R] tensor");
  TORCH_CHECK(!(want_output && gain.has_value()), "a logit gain makes statistics, not attention output");
  if (gain.has_value())
    TORCH_CHECK(gain->scalar_type() == at::kFloat && gain->is_contiguous() && gain->dim() == 2 &&
                    gain->size(0) == query.size(0) && gain->size(1) == query.size(1),
                "gain must be a contiguous float32 [R, Q] tensor");
  const int64_t rows = query.size(0);
  const int64_t width = rows ? lengths.max().item<int64_t>() : 0;
  Mask mask;
  if (valid.has_value()) {
    TORCH_CHECK(key_positions.has_value() && query_positions.has_value(), "a mask needs key and query positions");
    TORCH_CHECK(valid->scalar_type() == at::kBool && valid->is_contiguous() && valid->dim() == 2 &&
                    valid->size(0) == rows && valid->size(1) >= width,
                "valid must be a contiguous bool [R, >= max(lengths)] tensor");
    TORCH_CHECK(key_positions->scalar_type() == at::kLong && key_positions->is_contiguous() &&
                    key_positions->sizes() == valid->sizes(),
                "key_positions must be a contiguous int64 tensor shaped like valid");
    TORCH_CHECK(query_positions->scalar_type() == at::kLong && query_positions->is_contiguous() &&
                    query_positions->dim() == 2 && query_positions->size(0) == rows &&
                    query_positions->size(1) == query.size(1),
                "query_positions must be a contiguous int64 [R, Q] tensor");
    mask = Mask{valid->data_ptr<bool>(), key_positions->data_ptr<int64_t>(), query_positions->data_ptr<int64_t>(),
                valid->size(1), recent};
  }
  TORCH_CHECK(rows == 0 || lengths.min().item<int64_t>() >= query.size(1), "every row must hold its Q queries");
  at::Tensor output = want_output ? at::empty_like(query) : at::Tensor();
  at::Tensor sums = want_sums ? at::zeros({rows, width}, query.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor first =
      want_first ? at::empty({rows, query.size(1) * query.size(2)}, query.options().dtype(at::kFloat)) : at::Tensor();
  const bool float_queries = query.scalar_type() == at::kFloat;
  if (pages.scalar_type() == at::kFloat) {
    run<float, float>(query, pages, layout, tables, lengths, scale, gain, mask, want_output, want_sums, want_first, output,
                      sums, first);
  } else if (float_queries) {
    run<float, c10::BFloat16>(query, pages, layout, tables, lengths, scale, gain, mask, want_output, want_sums, want_first,
                              output, sums, first);
  } else {
    run<c10::BFloat16, c10::BFloat16>(query, pages, layout, tables, lengths, scale, gain, mask, want_output,
                                      want_sums, want_first, output, sums, first);
  }
  return {output, sums, first};
}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor pages, int layout, Tensor tables, Tensor lengths, float scale, "
      "Tensor? gain, Tensor? valid, Tensor? key_positions, Tensor? query_positions, int recent, bool want_output, "
      "bool want_sums, bool want_first) -> (Tensor, Tensor, Tensor)",
      &paged_attention);
}
