/* tilegraph C backend: the runtime's compiled part (runtime.h says what lives here).
 * build.py compiles it once per compiler, flags and processor into the shared
 * library every module links against; nothing model-specific is in it. */
#include "runtime.h"

#include <sys/mman.h>

char tg_err[1024];
static dnnl_engine_t tg_engine;
static dnnl_stream_t tg_stream;

const char *tg_error(void) { return tg_err; }

/* Every primitive created, one line each (kind, source dims, the implementation oneDNN
 * chose), and a count: the Python side reads the lines a binding added, reports the
 * kernels (`primitives`) and warns of any left on oneDNN's reference implementation. */
static int tg_prims;
static char tg_prim_lines[1 << 18];
int tg_primitive_count(void) { return tg_prims; }
const char *tg_primitive_report(void) { return tg_prim_lines; }

/* The precision of the GEMMs and convolutions created next: strict f32, or bf16 products
 * with f32 accumulation (oneDNN's fpmath mode: operands stay f32 in memory, its kernels
 * convert blocks to bf16 for the processor's AMX or AVX-512 BF16 units). The loader sets it
 * around a shape binding's primitive creation (runtime.py), so modules of either precision
 * live side by side in one process. */
static dnnl_fpmath_mode_t tg_fpmath = dnnl_fpmath_mode_strict;

/* Whether this processor (as oneDNN dispatches on it) has bf16 dot products. */
int tg_bf16_supported(void) {
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    return ((int)isa & (int)dnnl_cpu_isa_avx512_core_bf16) == (int)dnnl_cpu_isa_avx512_core_bf16;
}

/* Whether the processor has AMX tiles for bf16 (else AVX-512 BF16 runs them). */
int tg_amx_supported(void) {
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    return ((int)isa & (int)dnnl_cpu_isa_avx512_core_amx) == (int)dnnl_cpu_isa_avx512_core_amx;
}

void tg_set_bf16(int on) { tg_fpmath = on ? dnnl_fpmath_mode_bf16 : dnnl_fpmath_mode_strict; }
/* Whether the primitives created now multiply in bf16: a binding's state records it, and its
 * steps write the buffers its bf16 GEMMs read as they lie in bf16 (onednn.py, bf16_sources). */
int tg_bf16_on(void) { return tg_fpmath == dnnl_fpmath_mode_bf16; }

/* The precision of the kernels that call oneDNN's GEMM functions directly at run time
 * (tg_attention), set by the loader around a bf16 module's call: per calling thread, so
 * modules of either precision may run at once on different threads. Only where the
 * processor has bf16 dot products (runtime.py checks tg_bf16_supported first). */
static _Thread_local int tg_run_bf16;
void tg_set_run_bf16(int on) { tg_run_bf16 = on; }
/* Attention calls that multiplied in bf16 so far (tests check the path is taken). */
static int tg_bf16_attentions;
int tg_bf16_attention_count(void) { return __atomic_load_n(&tg_bf16_attentions, __ATOMIC_RELAXED); }
/* The multiply-adds of bf16 pairs those calls' products ran, padding included (tests check that
 * the AVX-512 BF16 products skip the tiles' padding). */
static int64_t tg_bf16_attention_macs;
int64_t tg_bf16_attention_pairs(void) { return __atomic_load_n(&tg_bf16_attention_macs, __ATOMIC_RELAXED); }

/* Packed weights and reorder scratch on the kernel's transparent huge pages, where it
 * offers them on request (/sys/kernel/mm/transparent_hugepage/enabled: always or madvise).
 * A forward streams every packed weight once (ResNet-50: ~100 MB, mostly from beyond the
 * cores' L2): with 4 KiB pages that is a TLB miss and a page walk every 4 KiB, which
 * onnxruntime's and our own convolution kernels then wait on. Only whole huge pages inside
 * an allocation are advised, so a small weight costs nothing extra. tg_set_huge_pages(0)
 * turns it off (benchmarks/c_steps.py --no-huge-pages measures the difference);
 * tg_huge_page_bytes() counts the bytes advised (tests check the path is taken). */
static int tg_huge = 1;
static size_t tg_huge_size; /* the huge page size, 0 when the kernel offers none; read once */
static size_t tg_huge_bytes;
void tg_set_huge_pages(int on) { tg_huge = on; }
size_t tg_huge_page_bytes(void) { return tg_huge_bytes; }

static size_t tg_huge_page_size(void) {
    static int known;
    if (known) return tg_huge_size;
    known = 1;
    char mode[128] = {0};
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return 0;
    size_t n = fread(mode, 1, sizeof mode - 1, f);
    fclose(f);
    mode[n] = 0;
    if (!strstr(mode, "[always]") && !strstr(mode, "[madvise]")) return 0;
    unsigned long long size = 0;
    f = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r");
    if (!f) return 0;
    if (fscanf(f, "%llu", &size) != 1) size = 0;
    fclose(f);
    if (size & (size - 1)) size = 0; /* (aligned_alloc needs a power of two) */
    tg_huge_size = (size_t)size;
    return tg_huge_size;
}

/* size bytes (64-aligned; rounded up to 64) for data a forward streams through. */
static void *tg_alloc_big(size_t size) {
    size_t huge = tg_huge ? tg_huge_page_size() : 0;
    size = (size + 63) / 64 * 64;
    if (!huge || size < huge) return aligned_alloc(64, size);
    void *p = aligned_alloc(huge, (size + huge - 1) / huge * huge);
    if (p && madvise(p, size / huge * huge, MADV_HUGEPAGE) == 0) tg_huge_bytes += size / huge * huge;
    return p;
}

static const char *tg_impl(const_dnnl_primitive_desc_t pd) {
    const char *impl = NULL;
    if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) != dnnl_success || !impl) return "?";
    return impl;
}

static int tg_is_ref(const_dnnl_primitive_desc_t pd) { return strncmp(tg_impl(pd), "ref", 3) == 0; }

/* Reorders run so far (tg_relayout's, the bf16 source conversions, a chained source taken
 * back to f32): a test reads it to see that chained convolutions pass their activations on
 * as they lie. */
static int tg_reorders;
int tg_reorder_count(void) { return tg_reorders; }

/* A line of the primitives' listing (tg_primitive_report): one per primitive made. */
static void tg_log_line(const char *line) {
    size_t used = strlen(tg_prim_lines), n = strlen(line);
    if (used + n >= sizeof tg_prim_lines) used = tg_prim_lines[0] = 0; /* full: the reader took the old lines */
    memcpy(tg_prim_lines + used, line, n + 1);
    tg_prims++;
}

static void tg_log_primitive(const_dnnl_primitive_desc_t pd, const_dnnl_memory_desc_t src, const char *note) {
    char line[256];
    int nd = 0, k;
    const dnnl_dims_t *dims = NULL;
    dnnl_primitive_kind_t kind = dnnl_undefined_primitive;
    dnnl_data_type_t wdt = dnnl_data_type_undef, ddt = dnnl_data_type_undef;
    dnnl_primitive_desc_query(pd, dnnl_query_primitive_kind, 0, &kind);
    dnnl_memory_desc_query(dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0), dnnl_query_data_type, &wdt);
    dnnl_memory_desc_query(dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0), dnnl_query_data_type, &ddt);
    dnnl_memory_desc_query(src, dnnl_query_ndims_s32, &nd);
    dnnl_memory_desc_query(src, dnnl_query_dims, &dims);
    k = snprintf(line, sizeof line, "%s%s of a ", kind == dnnl_convolution ? "convolution" : kind == dnnl_matmul ?
                 "matmul" : "primitive", wdt == dnnl_bf16 ? " (bf16 x bf16)" : "");
    for (int i = 0; i < nd && dims && k < 160; i++) k += snprintf(line + k, sizeof line - k, i ? "x%lld" : "%lld",
                                                                 (long long)(*dims)[i]);
    snprintf(line + k, sizeof line - k, "%s source: %s%s\n", ddt == dnnl_bf16 ? " (a bf16 result)" : "", tg_impl(pd),
             note);
    tg_log_line(line);
}

static void tg_log_prim(const tg_prim *g, const_dnnl_memory_desc_t src) {
    const_dnnl_primitive_desc_t pd = NULL;
    if (dnnl_primitive_get_primitive_desc(g->prim, &pd) == dnnl_success) tg_log_primitive(pd, src, g->re_wei ? " (its B reordered each run)" : "");
}

void tg_set_threads(int n) { if (n > 0) omp_set_num_threads(n); }
int tg_max_threads(void) { return omp_get_max_threads(); }

static int tg_runtime_init(void) {
    if (tg_engine) return 0;
    TG_DNNL(dnnl_engine_create(&tg_engine, dnnl_cpu, 0), "engine_create");
    TG_DNNL(dnnl_stream_create(&tg_stream, tg_engine, dnnl_stream_default_flags), "stream_create");
    return 0;
}

/* Whether the dims of size > 1, walked in `order` (outermost first), have non-increasing strides. */
static int tg_follows(int nd, const int64_t *dims, const int64_t *s, const int *order) {
    int64_t last = INT64_MAX;
    for (int k = 0; k < nd; k++) {
        int d = order[k];
        if (dims[d] == 1) continue;
        if (s[d] > last) return 0;
        last = s[d];
    }
    return 1;
}

/* Gives each dim of size 1 the stride a dense layout would give it. oneDNN picks its
 * kernels by matching strides against the layouts they take (plain, channels-last,
 * blocked), strides of size-1 dims included: a batch-1 NHWC source whose batch stride
 * was C read as layout `cdab`, which only the reference convolution takes (100-200x
 * slower). The other dims' strides say which layout is meant: plain (dims in order),
 * channels-last (dim 1 innermost) or a transposed last pair (a matmul's B^T); a size-1
 * dim goes where that layout puts it. Anything else: outside every dim after it. */
static void tg_unit_strides(int nd, const int64_t *dims, int64_t *s) {
    int orders[3][TG_MAX_DIMS], chosen = -1, any_unit = 0;
    for (int i = 0; i < nd; i++) any_unit |= dims[i] == 1;
    if (!any_unit) return;
    for (int i = 0; i < nd; i++) {
        orders[0][i] = i;
        orders[1][i] = i == 0 ? 0 : i == nd - 1 ? 1 : i + 1;
        orders[2][i] = i < nd - 2 ? i : (i == nd - 2 ? nd - 1 : nd - 2);
    }
    for (int c = 0; c < 3 && chosen < 0; c++)
        if ((c != 1 || nd >= 3) && (c != 2 || nd >= 2) && tg_follows(nd, dims, s, orders[c])) chosen = c;
    if (chosen >= 0) {
        int64_t inner = 1; /* the extent of what lies inside, walking outwards */
        for (int k = nd - 1; k >= 0; k--) {
            int d = orders[chosen][k];
            if (dims[d] == 1) s[d] = inner;
            else if (s[d] * dims[d] > inner) inner = s[d] * dims[d];
        }
        return;
    }
    for (int i = nd - 1; i >= 0; i--) {
        if (dims[i] != 1) continue;
        int64_t outer = 1;
        for (int j = i + 1; j < nd; j++)
            if (dims[j] != 1 && s[j] * dims[j] > outer) outer = s[j] * dims[j];
        s[i] = outer;
    }
}

static dnnl_memory_desc_t tg_md(int nd, const int64_t *dims, const int64_t *strides, dnnl_data_type_t dt) {
    dnnl_memory_desc_t md = NULL;
    dnnl_dims_t d, s;
    int64_t st[TG_MAX_DIMS];
    if (nd < 0 || nd > TG_MAX_DIMS) return NULL; /* st, d and s hold TG_MAX_DIMS entries */
    for (int i = 0; i < nd; i++) st[i] = strides[i];
    tg_unit_strides(nd, dims, st);
    for (int i = 0; i < nd; i++) { d[i] = dims[i]; s[i] = st[i]; }
    if (dnnl_memory_desc_create_with_strides(&md, nd, d, dt, s) != dnnl_success) return NULL;
    return md;
}

static dnnl_memory_desc_t tg_md_any(int nd, const int64_t *dims, dnnl_data_type_t dt) {
    dnnl_memory_desc_t md = NULL;
    dnnl_dims_t d;
    if (nd < 0 || nd > DNNL_MAX_NDIMS) return NULL;
    for (int i = 0; i < nd; i++) d[i] = dims[i];
    if (dnnl_memory_desc_create_with_tag(&md, nd, d, dt, dnnl_format_tag_any) != dnnl_success) return NULL;
    return md;
}

/* scale_mask: 0, or the mask of the weights' dim that has one scale per index
 * (oneDNN multiplies the accumulator by it before the post-ops). */
static int tg_attr(dnnl_primitive_attr_t *attr, int npost, const tg_post *posts, int scale_mask) {
    dnnl_post_ops_t po;
    TG_DNNL(dnnl_primitive_attr_create(attr), "attr_create");
    if (tg_fpmath != dnnl_fpmath_mode_strict)
        TG_DNNL(dnnl_primitive_attr_set_fpmath_mode(*attr, tg_fpmath), "set_fpmath_mode");
    if (scale_mask)
        TG_DNNL(dnnl_primitive_attr_set_scales_mask(*attr, DNNL_ARG_WEIGHTS, scale_mask), "set_scales_mask");
    if (!npost) return 0;
    TG_DNNL(dnnl_post_ops_create(&po), "post_ops_create");
    for (int i = 0; i < npost; i++) {
        if (posts[i].binary == TG_POST_SUM) {
            TG_DNNL(dnnl_post_ops_append_sum(po, 1.f, 0, dnnl_data_type_undef), "append_sum");
        } else if (posts[i].binary) {
            dnnl_memory_desc_t md = tg_md(posts[i].nd, posts[i].dims, posts[i].strides, dnnl_f32);
            if (!md) TG_FAIL("oneDNN rejected an epilogue operand's layout");
            TG_DNNL(dnnl_post_ops_append_binary(po, (dnnl_alg_kind_t)posts[i].alg, md), "append_binary");
            dnnl_memory_desc_destroy(md);
        } else {
            TG_DNNL(dnnl_post_ops_append_eltwise(po, (dnnl_alg_kind_t)posts[i].alg, posts[i].alpha, posts[i].beta),
                    "append_eltwise");
        }
    }
    TG_DNNL(dnnl_primitive_attr_set_post_ops(*attr, po), "set_post_ops");
    dnnl_post_ops_destroy(po);
    return 0;
}

/* Reorders `plain` (the weight as the model holds it) into pack->md once. */
static int tg_pack(tg_packed *pack, const_dnnl_memory_desc_t plain_md, const void *plain, const_dnnl_memory_desc_t want) {
    dnnl_primitive_desc_t rpd;
    dnnl_primitive_t reorder;
    dnnl_memory_t from, to;
    size_t size = dnnl_memory_desc_get_size(want);
    pack->data = tg_alloc_big(size);
    if (!pack->data) TG_FAIL("out of memory packing a weight (%zu bytes)", size);
    TG_DNNL(dnnl_memory_desc_clone(&pack->md, want), "md_clone");
    TG_DNNL(dnnl_reorder_primitive_desc_create(&rpd, plain_md, tg_engine, want, tg_engine, NULL), "reorder_pd");
    TG_DNNL(dnnl_primitive_create(&reorder, rpd), "reorder");
    TG_DNNL(dnnl_memory_create(&from, plain_md, tg_engine, (void *)plain), "memory_create");
    TG_DNNL(dnnl_memory_create(&to, want, tg_engine, pack->data), "memory_create");
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
    TG_DNNL(dnnl_primitive_execute(reorder, tg_stream, 2, args), "reorder");
    TG_DNNL(dnnl_stream_wait(tg_stream), "stream_wait");
    dnnl_primitive_destroy(reorder);
    dnnl_primitive_desc_destroy(rpd);
    dnnl_memory_destroy(from);
    dnnl_memory_destroy(to);
    return 0;
}

/* The memory objects a primitive runs on; handles are set on every run. */
/* Only a binary post-op has a second operand whose layout oneDNN is asked: an eltwise or sum
 * post-op has none, and what the query returned for one is not used. (Once in a MobileNetV2
 * run, before this asked only of binary ones, a process died inside dnnl_memory_desc_get_size
 * writing past the stack, as on a descriptor of garbage rank; not reproduced since.) */
static int tg_prim_memories(tg_prim *g, dnnl_primitive_desc_t pd, int npost, const tg_post *posts) {
    TG_DNNL(dnnl_memory_create(&g->src, dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0), tg_engine,
                               DNNL_MEMORY_NONE), "memory_create");
    TG_DNNL(dnnl_memory_create(&g->wei, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0), tg_engine,
                               DNNL_MEMORY_NONE), "memory_create");
    TG_DNNL(dnnl_memory_create(&g->dst, dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0), tg_engine,
                               DNNL_MEMORY_NONE), "memory_create");
    if (g->has_bias)
        TG_DNNL(dnnl_memory_create(&g->bias, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 1), tg_engine,
                                   DNNL_MEMORY_NONE), "memory_create");
    g->npost = 0;
    for (int i = 0; i < npost; i++) {
        g->post[i] = NULL;
        if (!posts[i].binary || posts[i].binary == TG_POST_SUM) continue;
        const_dnnl_memory_desc_t md = dnnl_primitive_desc_query_md(
            pd, dnnl_query_exec_arg_md, DNNL_ARG_ATTR_MULTIPLE_POST_OP(i) | DNNL_ARG_SRC_1);
        if (md && dnnl_memory_desc_get_size(md))
            TG_DNNL(dnnl_memory_create(&g->post[i], md, tg_engine, DNNL_MEMORY_NONE), "memory_create");
    }
    g->npost = npost;
    TG_DNNL(dnnl_primitive_create(&g->prim, pd), "primitive_create");
    return 0;
}

/* Chooses the weight layout: the packed one already made for this weight if the
 * primitive takes it, else the one the primitive prefers (packed now, once). */
typedef dnnl_status_t (*tg_pd_fn)(dnnl_primitive_desc_t *, const void *ctx, const_dnnl_memory_desc_t wei,
                                  const_dnnl_primitive_attr_t attr);

/* The head every primitive's context starts with: its source and destination. */
typedef struct {
    dnnl_memory_desc_t src, dst;
} tg_io;

/* A reorder between the caller's layout `user` and the primitive's `want`, through a
 * scratch buffer: the primitive's own (its bytes added to *own), or none where `arena`
 * bytes (the arena scratch its step passes, tg_prim_scratch) hold it; `into`: user -> want
 * (else want -> user). */
static int tg_reorder_step(dnnl_primitive_t *re, dnnl_memory_t *user_mem, void **tmp, size_t *own,
                           const_dnnl_memory_desc_t user, const_dnnl_memory_desc_t want, int into, size_t arena) {
    dnnl_primitive_desc_t rpd;
    size_t size = dnnl_memory_desc_get_size(want);
    *tmp = NULL;
    if (size > arena) {
        *tmp = tg_alloc_big(size + 64);
        if (!*tmp) TG_FAIL("out of memory for a reorder's scratch (%zu bytes)", size);
        *own += size + 64;
    }
    TG_DNNL(dnnl_reorder_primitive_desc_create(&rpd, into ? user : want, tg_engine, into ? want : user, tg_engine,
                                               NULL), "reorder_pd");
    TG_DNNL(dnnl_primitive_create(re, rpd), "reorder");
    dnnl_primitive_desc_destroy(rpd);
    TG_DNNL(dnnl_memory_create(user_mem, user, tg_engine, DNNL_MEMORY_NONE), "memory_create");
    return 0;
}

/* Whether `attr` accumulates into the destination (a TG_POST_SUM post-op). */
static int tg_has_sum(const_dnnl_primitive_attr_t attr) {
    const_dnnl_post_ops_t po = NULL;
    if (dnnl_primitive_attr_get_post_ops(attr, &po) != dnnl_success || !po) return 0;
    for (int i = 0; i < dnnl_post_ops_len(po); i++)
        if (dnnl_post_ops_get_kind(po, i) == dnnl_sum) return 1;
    return 0;
}

/* `pd` runs on the reference kernel in the caller's layouts: asks oneDNN for the layouts
 * it has a fast kernel for (source, weight and destination all `any`) and, where that
 * kernel is not ref, takes it with reorders around it (the weight packed once if it is
 * constant). Replaces *pd then; else leaves it (and the log says ref). */
static int tg_relayout(tg_prim *g, dnnl_primitive_desc_t *pd, tg_pd_fn make, const void *ctx, size_t ctx_size,
                       const_dnnl_memory_desc_t plain_wei, const void *weight, tg_packed *pack,
                       const_dnnl_primitive_attr_t attr, int nd_w, const int64_t *wdims, dnnl_data_type_t wdt) {
    const tg_io *io = ctx;
    char any_ctx[512];
    dnnl_primitive_desc_t fast = NULL;
    int nd_s, nd_d;
    const dnnl_dims_t *sd, *dd;
    dnnl_data_type_t st, dt;
    if (ctx_size > sizeof any_ctx) TG_FAIL("tg_relayout: context too large");
    memcpy(any_ctx, ctx, ctx_size);
    tg_io *any_io = (tg_io *)any_ctx;
    dnnl_memory_desc_query(io->src, dnnl_query_ndims_s32, &nd_s);
    dnnl_memory_desc_query(io->src, dnnl_query_dims, &sd);
    dnnl_memory_desc_query(io->src, dnnl_query_data_type, &st);
    dnnl_memory_desc_query(io->dst, dnnl_query_ndims_s32, &nd_d);
    dnnl_memory_desc_query(io->dst, dnnl_query_dims, &dd);
    dnnl_memory_desc_query(io->dst, dnnl_query_data_type, &dt);
    any_io->src = tg_md_any(nd_s, *sd, st);
    /* (a destination the primitive accumulates into stays where the caller keeps it: a
     * scratch in another layout would not hold the values to add) */
    any_io->dst = NULL;
    if (tg_has_sum(attr)) {
        if (dnnl_memory_desc_clone(&any_io->dst, io->dst) != dnnl_success) any_io->dst = NULL;
    } else {
        any_io->dst = tg_md_any(nd_d, *dd, dt);
    }
    dnnl_memory_desc_t any_w = tg_md_any(nd_w, wdims, wdt);
    if (any_io->src && any_io->dst && any_w && make(&fast, any_ctx, any_w, attr) == dnnl_success && tg_is_ref(fast)) {
        dnnl_primitive_desc_destroy(fast);
        fast = NULL;
    }
    int rc = 0;
    if (fast) {
        const_dnnl_memory_desc_t ws = dnnl_primitive_desc_query_md(fast, dnnl_query_src_md, 0);
        const_dnnl_memory_desc_t ww = dnnl_primitive_desc_query_md(fast, dnnl_query_weights_md, 0);
        const_dnnl_memory_desc_t wd = dnnl_primitive_desc_query_md(fast, dnnl_query_dst_md, 0);
        if (!dnnl_memory_desc_equal(ws, io->src))
            rc = rc || tg_reorder_step(&g->re_src, &g->user_src, &g->tmp_src, &g->own_bytes, io->src, ws, 1, 0);
        if (!dnnl_memory_desc_equal(wd, io->dst))
            rc = rc || tg_reorder_step(&g->re_dst, &g->user_dst, &g->tmp_dst, &g->own_bytes, io->dst, wd, 0, 0);
        if (!dnnl_memory_desc_equal(ww, plain_wei)) {
            /* (a constant weight another binding packed for another layout: reordered each run) */
            if (weight && (!pack->data || dnnl_memory_desc_equal(ww, pack->md))) {
                if (!pack->data) rc = rc || tg_pack(pack, plain_wei, weight, ww);
                g->wei_handle = pack->data;
            } else {
                g->wei_handle = NULL;
                rc = rc || tg_reorder_step(&g->re_wei, &g->user_wei, &g->tmp_wei, &g->own_bytes, plain_wei, ww, 1, 0);
            }
        } else {
            g->wei_handle = NULL;
        }
        dnnl_primitive_desc_destroy(*pd);
        *pd = fast;
    }
    if (any_io->src) dnnl_memory_desc_destroy(any_io->src);
    if (any_io->dst) dnnl_memory_desc_destroy(any_io->dst);
    if (any_w) dnnl_memory_desc_destroy(any_w);
    return rc;
}

/* The same dims and strides as `md`, of data type `dt`. */
static dnnl_memory_desc_t tg_md_retype(const_dnnl_memory_desc_t md, dnnl_data_type_t dt) {
    int nd = 0;
    const dnnl_dims_t *dims = NULL, *strides = NULL;
    dnnl_memory_desc_t out = NULL;
    if (dnnl_memory_desc_query(md, dnnl_query_ndims_s32, &nd) != dnnl_success || nd < 1 ||
        dnnl_memory_desc_query(md, dnnl_query_dims, &dims) != dnnl_success ||
        dnnl_memory_desc_query(md, dnnl_query_strides, &strides) != dnnl_success || !dims || !strides)
        return NULL;
    if (dnnl_memory_desc_create_with_strides(&out, nd, *dims, dt, *strides) != dnnl_success) return NULL;
    return out;
}

/* precision bf16 with a constant f32 weight: the primitive multiplies bf16 by bf16 (f32
 * accumulation, f32 destination and epilogue), its weight converted and packed once here,
 * its source converted each run by a reorder into a scratch of the primitive's own. With
 * fpmath mode alone oneDNN keeps the weight f32 and converts its blocks on every call: a
 * prompt through a 0.3B decoder was bound by that conversion and gained nothing from bf16.
 * Returns the primitive descriptor, or NULL (no bf16 kernel but the reference one, or a
 * weight another binding packed in a layout this one does not take): f32 with fpmath mode. */
static dnnl_primitive_desc_t tg_bf16_weights(tg_prim *g, tg_pd_fn make, const void *ctx, size_t ctx_size,
                                             const_dnnl_memory_desc_t plain_wei, const void *weight, tg_packed *pack,
                                             const_dnnl_primitive_attr_t attr, int nd_w, const int64_t *wdims) {
    const tg_io *io = ctx;
    char bf_ctx[512];
    dnnl_primitive_desc_t pd = NULL;
    dnnl_data_type_t st;
    if (ctx_size > sizeof bf_ctx || dnnl_memory_desc_query(io->src, dnnl_query_data_type, &st) != dnnl_success ||
        (st != dnnl_f32 && st != dnnl_bf16)) /* (bf16: a chained source, tg_conv_create) */
        return NULL;
    memcpy(bf_ctx, ctx, ctx_size);
    tg_io *bf_io = (tg_io *)bf_ctx;
    bf_io->src = tg_md_retype(io->src, dnnl_bf16);
    if (!bf_io->src) return NULL;
    if (pack->data) { /* another binding packed it: this one takes that layout, or keeps to f32 */
        dnnl_data_type_t pt;
        if (dnnl_memory_desc_query(pack->md, dnnl_query_data_type, &pt) != dnnl_success || pt != dnnl_bf16 ||
            make(&pd, bf_ctx, pack->md, attr) != dnnl_success)
            pd = NULL;
    } else {
        dnnl_memory_desc_t any = tg_md_any(nd_w, wdims, dnnl_bf16);
        if (!any || make(&pd, bf_ctx, any, attr) != dnnl_success) pd = NULL;
        if (any) dnnl_memory_desc_destroy(any);
    }
    if (pd && tg_is_ref(pd)) {
        dnnl_primitive_desc_destroy(pd);
        pd = NULL;
    }
    if (pd && !pack->data &&
        tg_pack(pack, plain_wei, weight, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0))) {
        dnnl_primitive_desc_destroy(pd);
        pd = NULL;
    }
    const_dnnl_memory_desc_t want = pd ? dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0) : NULL;
    if (pd && !dnnl_memory_desc_equal(want, io->src) &&
        tg_reorder_step(&g->re_src, &g->user_src, &g->tmp_src, &g->own_bytes, io->src, want, 1, 0)) {
        dnnl_primitive_desc_destroy(pd);
        pd = NULL;
    }
    if (pd) g->wei_handle = pack->data;
    dnnl_memory_desc_destroy(bf_io->src);
    return pd;
}

/* Whether a weight the caller passes each run (a training step's weight, an activation)
 * lies row-major with rows a multiple of 4 KiB apart: brgemm reads such a B in place, and
 * its rows then share a few L1 sets and evict each other (a 768x3072 f32 B ran at 0.4x the
 * speed of the same GEMM on MKL's packed copy; a transposed B is copied by brgemm itself).
 * The copy goes into the arena scratch the emitter reserved for its step (onednn.py,
 * _repack_scratch, which tests the same 4 KiB as tables.py's REPACK_ROW_BYTES).
 * TG_NO_REPACK=1 in the environment turns the repacking off, for a same-run A/B. */
static int tg_aliased_rows(const_dnnl_memory_desc_t md) {
    int nd = 0;
    const dnnl_dims_t *dims = NULL, *strides = NULL;
    dnnl_data_type_t dt = dnnl_data_type_undef;
    if (dnnl_memory_desc_query(md, dnnl_query_ndims_s32, &nd) != dnnl_success || nd < 2 ||
        dnnl_memory_desc_query(md, dnnl_query_dims, &dims) != dnnl_success ||
        dnnl_memory_desc_query(md, dnnl_query_strides, &strides) != dnnl_success ||
        dnnl_memory_desc_query(md, dnnl_query_data_type, &dt) != dnnl_success)
        return 0;
    size_t bytes = dt == dnnl_f32 || dt == dnnl_s32 ? 4 : dt == dnnl_bf16 || dt == dnnl_f16 ? 2 : 1;
    return (*dims)[nd - 2] > 1 && (*dims)[nd - 1] > 1 && (*strides)[nd - 1] == 1 &&
           ((*strides)[nd - 2] * bytes) % 4096 == 0;
}

/* wei_scratch: the arena bytes the step passes (tg_prim_scratch) for a B reordered each run. */
static int tg_prim_create(tg_prim *g, tg_pd_fn make, const void *ctx, size_t ctx_size, const_dnnl_memory_desc_t plain_wei,
                          const void *weight, tg_packed *pack, int npost, const tg_post *posts, int nd_w,
                          const int64_t *wdims, int scale_mask, size_t wei_scratch) {
    dnnl_primitive_attr_t attr;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_data_type_t wdt;
    if (tg_attr(&attr, npost, posts, scale_mask)) return 1;
    TG_DNNL(dnnl_memory_desc_query(plain_wei, dnnl_query_data_type, &wdt), "memory_desc_query");
    g->scaled = scale_mask != 0;
    g->wei_handle = NULL;
    if (weight && wdt == dnnl_f32 && tg_fpmath == dnnl_fpmath_mode_bf16)
        pd = tg_bf16_weights(g, make, ctx, ctx_size, plain_wei, weight, pack, attr, nd_w, wdims);
    if (pd) {
        /* (bf16 operands: the packed weight above, the source reordered each run) */
    } else if (weight && pack->data && make(&pd, ctx, pack->md, attr) == dnnl_success) {
        g->wei_handle = pack->data;
    } else if (weight && !pack->data) {
        dnnl_memory_desc_t any = tg_md_any(nd_w, wdims, wdt);
        if (any && make(&pd, ctx, any, attr) == dnnl_success) {
            const_dnnl_memory_desc_t want = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
            if (!dnnl_memory_desc_equal(want, plain_wei)) {
                if (tg_pack(pack, plain_wei, weight, want)) return 1;
                g->wei_handle = pack->data;
            } else {
                dnnl_primitive_desc_destroy(pd);
                pd = NULL;
            }
        }
        if (any) dnnl_memory_desc_destroy(any);
    } else if (!weight && tg_aliased_rows(plain_wei) && !getenv("TG_NO_REPACK")) {
        /* packed per run into the layout the kernel asks for: a reorder reads B once */
        dnnl_memory_desc_t any = tg_md_any(nd_w, wdims, wdt);
        if (any && make(&pd, ctx, any, attr) == dnnl_success) {
            const_dnnl_memory_desc_t want = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
            if (tg_is_ref(pd) || dnnl_memory_desc_equal(want, plain_wei)) {
                dnnl_primitive_desc_destroy(pd);
                pd = NULL;
            } else if (tg_reorder_step(&g->re_wei, &g->user_wei, &g->tmp_wei, &g->own_bytes, plain_wei, want, 1,
                                       wei_scratch)) {
                return 1;
            }
        }
        if (any) dnnl_memory_desc_destroy(any);
    }
    if (!pd) TG_DNNL(make(&pd, ctx, plain_wei, attr), "primitive_desc_create");
    if (tg_is_ref(pd) && tg_relayout(g, &pd, make, ctx, ctx_size, plain_wei, weight, pack, attr, nd_w, wdims, wdt))
        return 1;
    int rc = tg_prim_memories(g, pd, npost, posts);
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    return rc;
}

/* Frees what tg_prim_create made (a binding evicted from a model's cache); a zeroed
 * tg_prim (never created) is left as is. */
void tg_prim_destroy(tg_prim *g) {
    dnnl_memory_t mems[] = {g->src, g->wei, g->bias, g->dst, g->wei_scales};
    for (int i = 0; i < (int)(sizeof mems / sizeof *mems); i++)
        if (mems[i]) dnnl_memory_destroy(mems[i]);
    for (int i = 0; i < g->npost && i < TG_MAX_POST; i++)
        if (g->post[i]) dnnl_memory_destroy(g->post[i]);
    dnnl_memory_t users[] = {g->user_src, g->user_wei, g->user_dst, g->in_from, g->in_to};
    for (int i = 0; i < 5; i++)
        if (users[i]) dnnl_memory_destroy(users[i]);
    dnnl_primitive_t prims[] = {g->prim, g->re_src, g->re_wei, g->re_dst, g->re_in, g->re_acc};
    for (int i = 0; i < 6; i++)
        if (prims[i]) dnnl_primitive_destroy(prims[i]);
    if (g->wino) tg_wino_free(g->wino);
    if (g->sconv) tg_sconv_free(g->sconv);
    if (g->gemv) tg_gemv_free(g->gemv);
    free(g->tmp_src);
    free(g->tmp_wei);
    free(g->tmp_dst);
    free(g->tmp_in);
    memset(g, 0, sizeof *g);
}

/* The arena scratch of this run's step for a B reordered each run (its bytes were given to
 * tg_matmul_create): the arena moves between calls (a shared Workspace grows), so it is
 * passed each run. */
void tg_prim_scratch(tg_prim *g, void *scratch) { g->wei_arena = scratch; }

/* Runs a tg_relayout reorder between the caller's buffer (user_mem, handle `user`) and
 * the primitive's own memory `mine` (its handle the scratch): into mine, or out of it. */
static int tg_reorder_run(dnnl_primitive_t re, dnnl_memory_t user_mem, void *user, dnnl_memory_t mine, int into) {
    dnnl_memory_set_data_handle(user_mem, user);
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, into ? user_mem : mine}, {DNNL_ARG_TO, into ? mine : user_mem}};
    tg_reorders++;
    TG_DNNL(dnnl_primitive_execute(re, tg_stream, 2, args), "reorder");
    TG_DNNL(dnnl_stream_wait(tg_stream), "stream_wait");
    return 0;
}

/* bias: the convolution's bias, or the matmul's weight scales (one per column). */
int tg_prim_run(tg_prim *g, const void *src, const void *wei, const void *bias, void *dst,
                void *const *post) {
    dnnl_exec_arg_t args[5 + TG_MAX_POST];
    int n = 0;
    if (g->sgemm) {
        TG_DNNL(dnnl_sgemm(g->trans_a, g->trans_b, g->m, g->n, g->k, 1.f, src, g->lda, wei, g->ldb, 0.f, dst, g->ldc),
                "sgemm");
        return 0;
    }
    if (g->wino) return tg_wino_run(g, src, bias, dst, post);
    if (g->sconv) return tg_sconv_run(g, src, dst);
    if (g->gemv) return tg_gemv_run(g, src, bias, dst, post);
    if (g->re_in) { /* a chained source this primitive does not take as it lies: to f32 first */
        dnnl_memory_set_data_handle(g->in_to, g->tmp_in);
        if (tg_reorder_run(g->re_in, g->in_from, (void *)src, g->in_to, 1)) return 1;
        src = g->tmp_in;
    }
    dnnl_memory_set_data_handle(g->src, g->re_src ? g->tmp_src : (void *)src);
    void *reordered = g->tmp_wei ? g->tmp_wei : g->wei_arena;
    if (g->re_wei && !reordered) TG_FAIL("a GEMM whose B is reordered each run was run without its scratch");
    dnnl_memory_set_data_handle(g->wei, g->re_wei ? reordered : (void *)(g->wei_handle ? g->wei_handle : wei));
    dnnl_memory_set_data_handle(g->dst, g->re_dst ? g->tmp_dst : dst);
    if (g->re_src && tg_reorder_run(g->re_src, g->user_src, (void *)src, g->src, 1)) return 1;
    if (g->re_wei && tg_reorder_run(g->re_wei, g->user_wei, (void *)wei, g->wei, 1)) return 1;
    if (g->re_acc && tg_reorder_run(g->re_acc, g->user_dst, dst, g->dst, 1)) return 1;
    args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SRC, g->src};
    args[n++] = (dnnl_exec_arg_t){DNNL_ARG_WEIGHTS, g->wei};
    args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DST, g->dst};
    if (g->has_bias) {
        dnnl_memory_set_data_handle(g->bias, (void *)bias);
        args[n++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, g->bias};
    }
    if (g->scaled) {
        dnnl_memory_set_data_handle(g->wei_scales, (void *)bias);
        args[n++] = (dnnl_exec_arg_t){DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, g->wei_scales};
    }
    /* post[] holds the second operands of the binary post-ops only, in order. */
    for (int i = 0, b = 0; i < g->npost; i++) {
        if (!g->post[i]) continue;
        dnnl_memory_set_data_handle(g->post[i], post[b++]);
        args[n++] = (dnnl_exec_arg_t){DNNL_ARG_ATTR_MULTIPLE_POST_OP(i) | DNNL_ARG_SRC_1, g->post[i]};
    }
    TG_DNNL(dnnl_primitive_execute(g->prim, tg_stream, n, args), "execute");
    TG_DNNL(dnnl_stream_wait(tg_stream), "stream_wait");
    if (g->re_dst && tg_reorder_run(g->re_dst, g->user_dst, dst, g->dst, 0)) return 1;
    return 0;
}

/* --- matmul: C[..., M, N] = A[..., M, K] @ B[..., K, N], batch dims broadcast ---
 * types: oneDNN data types of A, B, C (f32 x f32 -> f32; s8 or u8 x s8 -> s32, or
 * -> f32 with one weight scale per column of B: `scaled`). */

typedef struct {
    dnnl_memory_desc_t src, dst; /* tg_io */
} tg_matmul_ctx;

static dnnl_status_t tg_matmul_pd(dnnl_primitive_desc_t *pd, const void *ctx, const_dnnl_memory_desc_t wei,
                                  const_dnnl_primitive_attr_t attr) {
    const tg_matmul_ctx *c = ctx;
    return dnnl_matmul_primitive_desc_create(pd, tg_engine, c->src, wei, NULL, c->dst, attr);
}

/* The ranks and post-op counts the runtime's fixed arrays hold (TG_MAX_DIMS: tg_md's copies,
 * a convolution's spatial parameters; TG_MAX_POST: tg_prim's post-op memories), checked before
 * anything is copied into them. The IR refuses a rank past 12 first (ir/shapes.py, MAX_RANK):
 * this stops a module that was not emitted from verified IR (an edited cache entry) at the
 * C boundary. */
static int tg_check_ranks(const char *what, int nd, int lowest, int w_nd, int npost, const tg_post *posts) {
    if (nd < lowest || nd > TG_MAX_DIMS)
        TG_FAIL("a %s of rank %d: the C runtime takes ranks %d to %d", what, nd, lowest, TG_MAX_DIMS);
    if (w_nd < 1 || w_nd > TG_MAX_DIMS)
        TG_FAIL("a %s whose weight has rank %d: the C runtime takes ranks 1 to %d", what, w_nd, TG_MAX_DIMS);
    if (npost < 0 || npost > TG_MAX_POST)
        TG_FAIL("a %s with %d post-ops: the C runtime takes at most %d", what, npost, TG_MAX_POST);
    for (int i = 0; i < npost; i++)
        if (posts[i].binary && posts[i].binary != TG_POST_SUM && (posts[i].nd < 0 || posts[i].nd > TG_MAX_DIMS))
            TG_FAIL("a %s whose post-op %d has an operand of rank %d: the C runtime takes ranks up to %d", what, i,
                    posts[i].nd, TG_MAX_DIMS);
    return 0;
}

/* A GEMM with a dim this long or longer (an LM head's vocabulary, as N or as K) runs on oneDNN's
 * sgemm, which blocks K and packs its panels, rather than its brgemm matmul, which keeps each
 * C block in registers over the whole K: f32, one thread, 1024x768 by a 50257 vocabulary,
 * sgemm ran the three LM-head GEMMs at 109-111 GFLOP/s where the matmul primitive took 98
 * (K = 50257) and 106 (N = 50257); at a transformer layer's shapes (dims <= 3072) the two were
 * within 2%, and there the matmul primitive fuses the epilogue. */
#define TG_SGEMM_MIN_DIM 16384

/* One row-major operand as sgemm reads it: 'N' (rows `ld` apart) or 'T' (its transpose, columns
 * `ld` apart); 0 where neither dim is unit-strided. */
static char tg_gemm_trans(const int64_t *dims, const int64_t *str, int64_t *ld) {
    if (str[1] == 1 && str[0] >= dims[1]) return *ld = str[0] > 1 ? str[0] : 1, 'N';
    if (str[0] == 1 && str[1] >= dims[0]) return *ld = str[1] > 1 ? str[1] : 1, 'T';
    return 0;
}

/* Whether this GEMM goes to sgemm (set up in g if so): 2-D, f32 throughout, nothing fused
 * (no post-ops, scales or bf16), B passed each run (a constant weight is packed once for the
 * matmul primitive instead), a dim of TG_SGEMM_MIN_DIM or more, C row-major.
 * TG_NO_SGEMM=1 in the environment keeps every GEMM on the matmul primitive, for a same-run A/B. */
static int tg_long_gemm(tg_prim *g, int nd, const int64_t *a_dims, const int64_t *a_str, const int64_t *b_dims,
                        const int64_t *b_str, const int64_t *c_dims, const int64_t *c_str, const int *types,
                        int scaled, const void *weight, int npost) {
    int64_t lda = 0, ldb = 0;
    if (nd != 2 || scaled || weight || npost || tg_fpmath != dnnl_fpmath_mode_strict || getenv("TG_NO_SGEMM") ||
        types[0] != dnnl_f32 || types[1] != dnnl_f32 || types[2] != dnnl_f32)
        return 0;
    int64_t m = c_dims[0], n = c_dims[1], k = a_dims[1];
    char ta = tg_gemm_trans(a_dims, a_str, &lda), tb = tg_gemm_trans(b_dims, b_str, &ldb);
    if (!ta || !tb || c_str[1] != 1 || c_str[0] < n || m < 1 || n < 1 || k < 1 ||
        (m < TG_SGEMM_MIN_DIM && n < TG_SGEMM_MIN_DIM && k < TG_SGEMM_MIN_DIM))
        return 0;
    *g = (tg_prim){.sgemm = 1, .trans_a = ta, .trans_b = tb, .m = m, .n = n, .k = k, .lda = lda, .ldb = ldb,
                   .ldc = c_str[0]};
    char line[160];
    snprintf(line, sizeof line, "matmul of a %lldx%lld source: sgemm:jit:f32 (a dim of %d or more)\n", (long long)m,
             (long long)k, TG_SGEMM_MIN_DIM);
    tg_log_line(line);
    return 1;
}

int tg_matmul_create(tg_prim *g, int nd, const int64_t *a_dims, const int64_t *a_str, const int64_t *b_dims,
                     const int64_t *b_str, const int64_t *c_dims, const int64_t *c_str, const int *types,
                     int scaled, const void *weight, tg_packed *pack, int npost, const tg_post *posts,
                     size_t wei_scratch) {
    if (tg_check_ranks("matmul", nd, 2, nd, npost, posts)) return 1;
    if (tg_long_gemm(g, nd, a_dims, a_str, b_dims, b_str, c_dims, c_str, types, scaled, weight, npost))
        return tg_runtime_init();
    tg_matmul_ctx ctx = {tg_md(nd, a_dims, a_str, types[0]), tg_md(nd, c_dims, c_str, types[2])};
    dnnl_memory_desc_t wei = tg_md(nd, b_dims, b_str, types[1]);
    if (tg_runtime_init()) return 1;
    if (!ctx.src || !ctx.dst || !wei) TG_FAIL("oneDNN rejected a matmul operand's layout");
    g->has_bias = 0;
    int rc = tg_prim_create(g, tg_matmul_pd, &ctx, sizeof ctx, wei, weight, pack, npost, posts, nd, b_dims,
                            scaled ? 1 << (nd - 1) : 0, wei_scratch);
    if (!rc && (types[0] == dnnl_bf16 || types[2] == dnnl_bf16)) {
        /* a source its producer wrote in bf16, or a result its readers take in bf16: no f32 kernel serves */
        const_dnnl_memory_desc_t wmd = NULL;
        dnnl_data_type_t wt = dnnl_data_type_undef;
        if (dnnl_memory_get_memory_desc(g->wei, &wmd) == dnnl_success)
            dnnl_memory_desc_query(wmd, dnnl_query_data_type, &wt);
        if (wt != dnnl_bf16) {
            snprintf(tg_err, sizeof tg_err, "oneDNN has no bf16 matmul to read or write a bf16 activation buffer");
            rc = 1;
        }
    }
    if (!rc) tg_log_prim(g, ctx.src);
    if (!rc && scaled) { /* the scales: f32, one per column */
        int64_t one = 1;
        dnnl_memory_desc_t md = tg_md(1, &b_dims[nd - 1], &one, dnnl_f32);
        if (!md) TG_FAIL("oneDNN rejected the weight scales' layout");
        TG_DNNL(dnnl_memory_create(&g->wei_scales, md, tg_engine, DNNL_MEMORY_NONE), "memory_create");
        dnnl_memory_desc_destroy(md);
    }
    dnnl_memory_desc_destroy(ctx.src);
    dnnl_memory_desc_destroy(ctx.dst);
    dnnl_memory_desc_destroy(wei);
    return rc;
}

/* --- row kernels: rows of n contiguous floats --- */

/* In place is fine (y == x). */
void tg_softmax_rows(const float *x, float *y, int64_t rows, int64_t n) {
#pragma omp parallel for if (rows * n > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        /* A NaN in the row needs no special case: x - m carries it into the sum. */
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; j++) m = xr[j] > m ? xr[j] : m;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; j++) {
            float e = tg_expf(xr[j] - m);
            yr[j] = e;
            s += e;
        }
        float inv = 1.f / s;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) yr[j] *= inv;
    }
}

/* Element j of a row normalized (x - mean) * inv, times scale[j], plus bias[j] (each may be NULL). */
static inline float tg_normed(float x, int64_t j, float mean, float inv, const float *scale, const float *bias) {
    float t = (x - mean) * inv;
    if (scale) t *= scale[j];
    if (bias) t += bias[j];
    return t;
}

/* Normalizes each row of n over all of it; scale and bias (n each) may be NULL. The result
 * in f32 at y, or where y16 is given, in bf16 there (a buffer only bf16 GEMMs read: onednn.py,
 * bf16_sources), computed in f32 alike. */
static void tg_layer_norm_to(const float *x, float *y, uint16_t *y16, const float *scale, const float *bias,
                             int64_t rows, int64_t n, float eps) {
#pragma omp parallel for if (rows * n > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; j++) s += xr[j];
        float mean = s / (float)n, v = 0.f;
#pragma omp simd reduction(+ : v)
        for (int64_t j = 0; j < n; j++) v += (xr[j] - mean) * (xr[j] - mean);
        float inv = 1.f / sqrtf(v / (float)n + eps);
        if (y16) {
            uint16_t *yr = y16 + r * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) yr[j] = tg_f2bf(tg_normed(xr[j], j, mean, inv, scale, bias));
        } else {
            float *yr = y + r * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) yr[j] = tg_normed(xr[j], j, mean, inv, scale, bias);
        }
    }
}

/* tg.layer_norm over an axis of n laid out `inner` apart: x is [outer][n][inner] (a
 * channels-last (N, C, ..., T) normalized along T, inner = C), each of the outer * inner
 * columns normalized on its own. Each thread takes blocks of LN_COLS neighbouring columns
 * and walks them down the n rows, so every load is a run of contiguous floats; the sums
 * are in double, as a column has no simd partial sums to spread its rounding over. */
#define LN_COLS 64
void tg_layer_norm_cols(const float *x, float *y, const float *scale, const float *bias, int64_t outer,
                        int64_t n, int64_t inner, float eps) {
    int64_t blocks = (inner + LN_COLS - 1) / LN_COLS;
#pragma omp parallel for if (outer * n * inner > 16384)
    for (int64_t b = 0; b < outer * blocks; b++) {
        int64_t o = b / blocks, c0 = (b % blocks) * LN_COLS;
        int64_t w = inner - c0 < LN_COLS ? inner - c0 : LN_COLS;
        const float *xo = x + o * n * inner + c0;
        float *yo = y + o * n * inner + c0;
        double s[LN_COLS] = {0}, v[LN_COLS] = {0};
        float mean[LN_COLS], inv[LN_COLS];
        for (int64_t j = 0; j < n; j++) {
#pragma omp simd
            for (int64_t c = 0; c < w; c++) s[c] += xo[j * inner + c];
        }
        for (int64_t c = 0; c < w; c++) mean[c] = (float)(s[c] / (double)n);
        for (int64_t j = 0; j < n; j++) {
#pragma omp simd
            for (int64_t c = 0; c < w; c++) {
                double d = xo[j * inner + c] - mean[c];
                v[c] += d * d;
            }
        }
        for (int64_t c = 0; c < w; c++) inv[c] = 1.f / sqrtf((float)(v[c] / (double)n) + eps);
        for (int64_t j = 0; j < n; j++) {
            float sc = scale ? scale[j] : 1.f, bi = bias ? bias[j] : 0.f;
#pragma omp simd
            for (int64_t c = 0; c < w; c++) yo[j * inner + c] = (xo[j * inner + c] - mean[c]) * inv[c] * sc + bi;
        }
    }
}

void tg_layer_norm_rows(const float *x, float *y, const float *scale, const float *bias, int64_t rows, int64_t n,
                        float eps) {
    tg_layer_norm_to(x, y, NULL, scale, bias, rows, n, eps);
}

void tg_layer_norm_rows_bf16(const float *x, uint16_t *y, const float *scale, const float *bias, int64_t rows,
                             int64_t n, float eps) {
    tg_layer_norm_to(x, NULL, y, scale, bias, rows, n, eps);
}

/* tg.dynamic_quantize to i8, one scale per row of n: max|x| / 127 (at least FLT_MIN;
 * 1 for a row of zeros or with a NaN), q = saturate(rint(x / scale)). */
void tg_dynamic_quantize_rows(const float *x, int8_t *q, float *scale, int64_t rows, int64_t n) {
#pragma omp parallel for if (rows * n > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        int8_t *qr = q + r * n;
        float m = 0.f;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t j = 0; j < n; j++) {
            float a = fabsf(xr[j]);
            m = a > m ? a : m;
            nan |= a != a;
        }
        float s = m > 0.f && !nan ? fmaxf(m / 127.f, 1.17549435e-38f) : 1.f;
        scale[r] = s;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) qr[j] = (int8_t)tg_saturate(rintf(xr[j] / s), -128.f, 127.f);
    }
}
