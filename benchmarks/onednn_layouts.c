/* One oneDNN convolution per shape in three activation layouts, timed interleaved in one
 * process on the same data: channels-last (acdb, the C backend's), nChw16c and nChw8c
 * (aBcd16b/aBcd8b, onnxruntime's NCHWc). Weights are format `any` (packed once). Driven by
 * onednn_layouts.py, which builds it against the oneDNN the C backend links. */
#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static dnnl_engine_t eng;
static dnnl_stream_t st;
#define CK(x) do { if ((x) != dnnl_success) { fprintf(stderr, "failed: %s\n", #x); exit(1); } } while (0)

typedef struct { dnnl_primitive_t p; dnnl_memory_t s, w, b, d; char impl[64]; } conv_t;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void fill(dnnl_memory_t m, float scale) {
    void *h; const_dnnl_memory_desc_t md;
    dnnl_memory_get_data_handle(m, &h);
    dnnl_memory_get_memory_desc(m, &md);
    size_t n = dnnl_memory_desc_get_size(md) / 4;
    for (size_t i = 0; i < n; i++) ((float *)h)[i] = (float)(i % 7) * scale;
}

static int batch = 1; /* TG_LAYOUTS_BATCH */

/* post: 0 relu, 1 sum then relu (a residual block's end), 2 swish, 3 hardswish (MobileNetV3's) */
static conv_t make(int dw, int ic, int oc, int ih, int k, int s, dnnl_format_tag_t tag, int post) {
    int oh = (ih + 2 * (k / 2) - k) / s + 1;
    dnnl_dims_t sd = {batch, ic, ih, ih}, dd = {batch, dw ? ic : oc, oh, oh}, bd = {dw ? ic : oc}, str = {s, s}, dil = {0, 0},
                pad = {k / 2, k / 2}, wd = {oc, ic, k, k}, gwd = {ic, 1, 1, k, k};
    dnnl_memory_desc_t smd, wmd, bmd, dmd;
    CK(dnnl_memory_desc_create_with_tag(&smd, 4, sd, dnnl_f32, tag));
    CK(dnnl_memory_desc_create_with_tag(&wmd, dw ? 5 : 4, dw ? gwd : wd, dnnl_f32, dnnl_format_tag_any));
    CK(dnnl_memory_desc_create_with_tag(&bmd, 1, bd, dnnl_f32, dnnl_a));
    CK(dnnl_memory_desc_create_with_tag(&dmd, 4, dd, dnnl_f32, tag));
    dnnl_primitive_attr_t attr;
    dnnl_post_ops_t po;
    CK(dnnl_primitive_attr_create(&attr));
    CK(dnnl_post_ops_create(&po));
    if (post == 1) CK(dnnl_post_ops_append_sum(po, 1.f, 0, dnnl_data_type_undef));
    if (post == 3) CK(dnnl_post_ops_append_eltwise(po, dnnl_eltwise_hardswish, 1.f / 6, 0.5f));
    else CK(dnnl_post_ops_append_eltwise(po, post == 2 ? dnnl_eltwise_swish : dnnl_eltwise_relu, 1.f, 0.f));
    CK(dnnl_primitive_attr_set_post_ops(attr, po));
    dnnl_primitive_desc_t pd;
    conv_t c;
    const char *impl = "?";
    CK(dnnl_convolution_forward_primitive_desc_create(&pd, eng, dnnl_forward_inference, dnnl_convolution_direct, smd,
                                                      wmd, bmd, dmd, str, dil, pad, pad, attr));
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    snprintf(c.impl, sizeof c.impl, "%s", impl);
    CK(dnnl_primitive_create(&c.p, pd));
    CK(dnnl_memory_create(&c.s, dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0), eng, DNNL_MEMORY_ALLOCATE));
    CK(dnnl_memory_create(&c.w, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0), eng, DNNL_MEMORY_ALLOCATE));
    CK(dnnl_memory_create(&c.b, bmd, eng, DNNL_MEMORY_ALLOCATE));
    CK(dnnl_memory_create(&c.d, dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0), eng, DNNL_MEMORY_ALLOCATE));
    fill(c.s, 0.1f); fill(c.w, 0.01f); fill(c.b, 0.f); fill(c.d, 0.f);
    return c;
}

static double run(conv_t *c) {
    dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, c->s}, {DNNL_ARG_WEIGHTS, c->w}, {DNNL_ARG_BIAS, c->b}, {DNNL_ARG_DST, c->d}};
    double t = now();
    dnnl_primitive_execute(c->p, st, 4, a);
    dnnl_stream_wait(st);
    return now() - t;
}

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }

/* argv: repeats, post, then shapes as dw,ic,oc,ih,k,s groups */
int main(int argc, char **argv) {
    enum { R = 101 };
    int repeat = atoi(argv[1]) < R ? atoi(argv[1]) : R, post = atoi(argv[2]);
    if (getenv("TG_LAYOUTS_BATCH")) batch = atoi(getenv("TG_LAYOUTS_BATCH"));
    dnnl_format_tag_t tags[3] = {dnnl_acdb, dnnl_aBcd16b, dnnl_aBcd8b};
    double total[3] = {0};
    CK(dnnl_engine_create(&eng, dnnl_cpu, 0));
    CK(dnnl_stream_create(&st, eng, dnnl_stream_default_flags));
    for (int a = 3; a + 5 < argc; a += 6) {
        int v[6];
        for (int j = 0; j < 6; j++) v[j] = atoi(argv[a + j]);
        conv_t c[3];
        double ts[3][R], m[3];
        for (int t = 0; t < 3; t++) c[t] = make(v[0], v[1], v[2], v[3], v[4], v[5], tags[t], post);
        for (int r = 0; r < repeat; r++)
            for (int t = 0; t < 3; t++) ts[t][r] = run(&c[t]);
        for (int t = 0; t < 3; t++) {
            qsort(ts[t], repeat, sizeof(double), cmp);
            m[t] = ts[t][repeat / 2] * 1e3;
            total[t] += m[t];
        }
        printf("%s ic%d oc%d ih%d k%d s%d | acdb %.3f ms %s | 16c %.3f ms %s | 8c %.3f ms %s | 16c/acdb %.2f\n",
               v[0] ? "dw" : "  ", v[1], v[2], v[3], v[4], v[5], m[0], c[0].impl, m[1], c[1].impl, m[2], c[2].impl,
               m[1] / m[0]);
    }
    printf("total: acdb %.2f ms, 16c %.2f ms (%.2fx), 8c %.2f ms (%.2fx)\n", total[0], total[1], total[1] / total[0],
           total[2], total[2] / total[0]);
    return 0;
}
