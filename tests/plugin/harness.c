/*
 * Drives roccl's NCCL/RCCL network plugin the way NCCL's proxy does.
 *
 *   harness [LIBNAME]     (default libnccl-net-roccl.so, found through LD_LIBRARY_PATH)
 *   harness --lookup LOADER EXPECT VERSION
 *                         (find the plugin as LOADER would from NCCL_NET_PLUGIN: see
 *                         "The loaders' lookup" below)
 *
 * 1. Loads the library with dlopen and looks the plugin up as NCCL does: ncclNetPlugin_v12,
 *    then v11 ... down to v8; reports the first found.
 * 2. For every exported version v12 .. v8, two processes (fork, then each dlopens the plugin)
 *    exchange the listen handle over a pipe, poll connect/accept until non-NULL, register
 *    their buffers, and move MSGS messages of 0 B to 4 MiB with up to 32 requests in flight:
 *    single and grouped receives (tags matched in shuffled order), every size and byte
 *    checked, iflush after each receive, deregistration, close; v11/v12 with a context
 *    (init/finalize). The network is what ROCCL_NET says (the test script runs tcp and
 *    rocev2).
 * 3. Misuse: NULL and closed comms, bad requests and double closes return errors.
 * Exits 0 when everything passed; prints what failed otherwise.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <limits.h>
#include <libgen.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int res_t; /* ncclResult_t */
typedef void (*logger_t)(int level, unsigned long flags, const char *file, int line, const char *fmt, ...);
typedef res_t (*prof_t)(void **, int, void *, int64_t, void *);

#define HANDLE_SIZE 128
#define MAX_REQ 32
#define MAX_RECVS 8
#define MSGS 300
#define MAXMSG (4u << 20)

/* ---- NCCL's structs, per version (layouts of net_v8.h .. net_v12.h) -------------------- */
typedef struct { int ndevs; int devs[4]; } vprops4_t;
typedef struct { int ndevs; int devs[8]; } vprops8_t;
typedef struct { int trafficClass; } commcfg_t;

typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int speed; int port;
  float latency; int maxComms; int maxRecvs; int netDeviceType; int netDeviceVersion;
} props_v8_t;
typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush;
  int speed; int port; float latency; int maxComms; int maxRecvs; int netDeviceType;
  int netDeviceVersion; vprops4_t vProps; size_t maxP2pBytes; size_t maxCollBytes;
} props_v9_t; /* also v10 */
typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush;
  int speed; int port; float latency; int maxComms; int maxRecvs; int netDeviceType;
  int netDeviceVersion; vprops4_t vProps; size_t maxP2pBytes; size_t maxCollBytes;
  int maxMultiRequestSize;
} props_v11_t;
typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush;
  int speed; int port; float latency; int maxComms; int maxRecvs; int netDeviceType;
  int netDeviceVersion; vprops8_t vProps; size_t maxP2pBytes; size_t maxCollBytes;
  int maxMultiRequestSize; int16_t railId; int16_t planeId;
} props_v12_t;

#define COMMON_TAIL(PROPS, ISEND, IRECV, VP)                                                 \
  res_t (*regMr)(void *, void *, size_t, int, void **);                                     \
  res_t (*regMrDmaBuf)(void *, void *, size_t, int, uint64_t, int, void **);                \
  res_t (*deregMr)(void *, void *);                                                         \
  ISEND;                                                                                     \
  IRECV;                                                                                     \
  res_t (*iflush)(void *, int, void **, int *, void **, void **);                           \
  res_t (*test)(void *, int *, int *);                                                      \
  res_t (*closeSend)(void *);                                                               \
  res_t (*closeRecv)(void *);                                                               \
  res_t (*closeListen)(void *);                                                             \
  res_t (*getDeviceMr)(void *, void *, void **);                                            \
  res_t (*irecvConsumed)(void *, int, void *);

typedef struct {
  const char *name;
  res_t (*init)(logger_t);
  res_t (*devices)(int *);
  res_t (*getProperties)(int, props_v8_t *);
  res_t (*listen)(int, void *, void **);
  res_t (*connect)(int, void *, void **, void **);
  res_t (*accept)(void *, void **, void **);
  COMMON_TAIL(props_v8_t, res_t (*isend)(void *, void *, int, int, void *, void **),
              res_t (*irecv)(void *, int, void **, int *, int *, void **, void **), x)
} net_v8_t;
typedef struct {
  const char *name;
  res_t (*init)(logger_t);
  res_t (*devices)(int *);
  res_t (*getProperties)(int, props_v9_t *);
  res_t (*listen)(int, void *, void **);
  res_t (*connect)(int, void *, void **, void **);
  res_t (*accept)(void *, void **, void **);
  COMMON_TAIL(props_v9_t, res_t (*isend)(void *, void *, size_t, int, void *, void **),
              res_t (*irecv)(void *, int, void **, size_t *, int *, void **, void **), x)
  res_t (*makeVDevice)(int *, vprops4_t *);
} net_v9_t;
typedef struct {
  const char *name;
  res_t (*init)(logger_t, prof_t);
  res_t (*devices)(int *);
  res_t (*getProperties)(int, props_v9_t *);
  res_t (*listen)(int, void *, void **);
  res_t (*connect)(int, commcfg_t *, void *, void **, void **);
  res_t (*accept)(void *, void **, void **);
  COMMON_TAIL(props_v9_t, res_t (*isend)(void *, void *, size_t, int, void *, void *, void **),
              res_t (*irecv)(void *, int, void **, size_t *, int *, void **, void **, void **), x)
  res_t (*makeVDevice)(int *, vprops4_t *);
} net_v10_t;
#define NET_V11_LIKE(T, PROPS, VP)                                                             \
  typedef struct {                                                                           \
    const char *name;                                                                        \
    res_t (*init)(void **, uint64_t, commcfg_t *, logger_t, prof_t);                         \
    res_t (*devices)(int *);                                                                 \
    res_t (*getProperties)(int, PROPS *);                                                    \
    res_t (*listen)(void *, int, void *, void **);                                           \
    res_t (*connect)(void *, int, void *, void **, void **);                                 \
    res_t (*accept)(void *, void **, void **);                                               \
    COMMON_TAIL(PROPS, res_t (*isend)(void *, void *, size_t, int, void *, void *, void **), \
                res_t (*irecv)(void *, int, void **, size_t *, int *, void **, void **, void **), x) \
    res_t (*makeVDevice)(int *, VP *);                                                       \
    res_t (*finalize)(void *);                                                               \
    res_t (*setNetAttr)(void *, void *);                                                     \
  } T;
NET_V11_LIKE(net_v11_t, props_v11_t, vprops4_t)
NET_V11_LIKE(net_v12_t, props_v12_t, vprops8_t)

_Static_assert(sizeof(props_v8_t) == 64, "v8 properties");
_Static_assert(sizeof(props_v9_t) == 104, "v9 properties");
_Static_assert(sizeof(props_v11_t) == 112, "v11 properties");
_Static_assert(sizeof(props_v12_t) == 128, "v12 properties");

/* ---- one uniform view over the versions -------------------------------------------------- */
typedef struct {
  int v;
  void *tbl;
  void *ctx;
} net_t;

static int failures;
#define CHECK(cond, ...)                                                                     \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      fprintf(stderr, "[pid %d] FAIL %s:%d: ", (int)getpid(), __FILE__, __LINE__);          \
      fprintf(stderr, __VA_ARGS__);                                                          \
      fprintf(stderr, "\n");                                                                 \
      failures++;                                                                            \
      return -1;                                                                             \
    }                                                                                        \
  } while (0)

static int logged;
/* NCCL's logger: count every line, print warnings (as NCCL_DEBUG=WARN would). */
static void logger(int level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags; (void)file; (void)line;
  logged++;
  if (level <= 2 || getenv("HARNESS_VERBOSE")) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[pid %d] NCCL %s: ", (int)getpid(), level <= 2 ? "WARN" : "INFO");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
  }
}

#define T(type) ((type *)n->tbl)
static res_t n_init(net_t *n) {
  switch (n->v) {
  case 8: return T(net_v8_t)->init(logger);
  case 9: return T(net_v9_t)->init(logger);
  case 10: return T(net_v10_t)->init(logger, NULL);
  case 11: { commcfg_t c = {-1}; return T(net_v11_t)->init(&n->ctx, 42, &c, logger, NULL); }
  default: { commcfg_t c = {-1}; return T(net_v12_t)->init(&n->ctx, 42, &c, logger, NULL); }
  }
}
/* Every table starts with name, init, devices, getProperties. */
static res_t n_devices(net_t *n, int *nd) { return T(net_v8_t)->devices(nd); }
static res_t n_props(net_t *n, int dev, int *maxRecvs, int *ptr, size_t *maxp2p, char **name) {
  res_t r;
  *maxp2p = (size_t)-1;
  switch (n->v) {
  case 8: { props_v8_t p; r = T(net_v8_t)->getProperties(dev, &p); *maxRecvs = p.maxRecvs; *ptr = p.ptrSupport; *name = p.name; break; }
  case 9: case 10: { props_v9_t p; r = T(net_v9_t)->getProperties(dev, &p); *maxRecvs = p.maxRecvs; *ptr = p.ptrSupport; *name = p.name; *maxp2p = p.maxP2pBytes; break; }
  case 11: { props_v11_t p; r = T(net_v11_t)->getProperties(dev, &p); *maxRecvs = p.maxRecvs; *ptr = p.ptrSupport; *name = p.name; *maxp2p = p.maxP2pBytes; break; }
  default: { props_v12_t p; r = T(net_v12_t)->getProperties(dev, &p); *maxRecvs = p.maxRecvs; *ptr = p.ptrSupport; *name = p.name; *maxp2p = p.maxP2pBytes; break; }
  }
  return r;
}
static res_t n_listen(net_t *n, void *h, void **l) {
  if (n->v >= 11) return T(net_v11_t)->listen(n->ctx, 0, h, l);
  return T(net_v8_t)->listen(0, h, l);
}
static res_t n_connect(net_t *n, void *h, void **s) {
  void *dev = (void *)1;
  res_t r;
  if (n->v >= 11) r = T(net_v11_t)->connect(n->ctx, 0, h, s, &dev);
  else if (n->v == 10) { commcfg_t c = {-1}; r = T(net_v10_t)->connect(0, &c, h, s, &dev); }
  else r = T(net_v8_t)->connect(0, h, s, &dev);
  if (r == 0 && dev != NULL) return 99; /* the device handle must be set to NULL */
  return r;
}
/* accept/regMr/regMrDmaBuf/deregMr sit at the same place in every table. */
static res_t n_accept(net_t *n, void *l, void **c) { void *d = (void *)1; res_t r = T(net_v8_t)->accept(l, c, &d); return r == 0 && d ? 99 : r; }
/* Buffers are registered as host memory, or as GPU memory (NCCL_PTR_CUDA) when the network
 * advertises it (ROCCL_ROCEV2_SIM_GPU=1: the userspace engine takes host memory for it). */
static int reg_type = 1;
/* With NCCL_PTR_DMABUF too, the arena is a memfd mapping registered through regMrDmaBuf: the
 * userspace engine maps the fd itself, as a NIC maps GPU memory. */
static int dmabuf_fd = -1;
static char *dmabuf_base;
static res_t n_regmr(net_t *n, void *c, void *p, size_t sz, void **mh) {
  if (dmabuf_fd >= 0)
    return T(net_v8_t)->regMrDmaBuf(c, p, sz, reg_type, (uint64_t)((char *)p - dmabuf_base), dmabuf_fd, mh);
  return T(net_v8_t)->regMr(c, p, sz, reg_type, mh);
}
static res_t n_deregmr(net_t *n, void *c, void *mh) { return T(net_v8_t)->deregMr(c, mh); }
static res_t n_isend(net_t *n, void *c, void *p, size_t sz, int tag, void *mh, void **req) {
  switch (n->v) {
  case 8: return T(net_v8_t)->isend(c, p, (int)sz, tag, mh, req);
  case 9: return T(net_v9_t)->isend(c, p, sz, tag, mh, req);
  case 10: return T(net_v10_t)->isend(c, p, sz, tag, mh, NULL, req);
  default: return T(net_v11_t)->isend(c, p, sz, tag, mh, NULL, req);
  }
}
static res_t n_irecv(net_t *n, void *c, int k, void **p, size_t *sz, int *tags, void **mh, void **req) {
  if (n->v == 8) {
    int isz[MAX_RECVS];
    for (int i = 0; i < k; i++) isz[i] = (int)sz[i];
    return T(net_v8_t)->irecv(c, k, p, isz, tags, mh, req);
  }
  if (n->v == 9) return T(net_v9_t)->irecv(c, k, p, sz, tags, mh, req);
  if (n->v == 10) return T(net_v10_t)->irecv(c, k, p, sz, tags, mh, NULL, req);
  return T(net_v11_t)->irecv(c, k, p, sz, tags, mh, NULL, req);
}
/* iflush .. irecvConsumed: same offsets in v8/v9 (int/size_t isend changes nothing in size). */
#define TAIL(n, f) (n->v == 8 ? T(net_v8_t)->f : n->v == 9 ? T(net_v9_t)->f : n->v == 10 ? T(net_v10_t)->f : n->v == 11 ? T(net_v11_t)->f : T(net_v12_t)->f)

/* ---- the exchange ----------------------------------------------------------------------- */
static uint64_t rng = 88172645463325252ull;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

typedef struct { int n; size_t size[MAX_RECVS]; int tag[MAX_RECVS]; int order[MAX_RECVS]; } group_t;
static group_t plan[MSGS];
static int nplan;

/* The same plan on both sides: receives of 1..maxRecvs buffers, sizes 0 B .. 4 MiB. */
static void make_plan(int maxRecvs) {
  rng = 88172645463325252ull;
  int msgs = 0;
  for (nplan = 0; msgs < MSGS; nplan++) {
    group_t *g = &plan[nplan];
    g->n = (next() % 4 == 0) ? 1 + (int)(next() % (uint64_t)maxRecvs) : 1;
    if (msgs + g->n > MSGS) g->n = MSGS - msgs;
    for (int i = 0; i < g->n; i++) {
      uint64_t r = next() % 100;
      size_t s = r < 5 ? 0 : r < 60 ? next() % 4097 : r < 90 ? next() % 262145 : r < 97 ? (1u << 20) : MAXMSG;
      g->size[i] = s;
      g->tag[i] = 100 + i;
      g->order[i] = i;
    }
    for (int i = g->n - 1; i > 0; i--) { /* the sender sends a group's messages shuffled */
      int j = (int)(next() % (uint64_t)(i + 1)), t = g->order[i];
      g->order[i] = g->order[j];
      g->order[j] = t;
    }
    msgs += g->n;
  }
}

static unsigned char byte_of(int group, int buf, size_t i) { return (unsigned char)(group * 31 + buf * 7 + i * 13 + (i >> 9)); }

#define SLOT (MAXMSG + 64)

static int run_sender(net_t *n, void *s, char *arena, void *mh) {
  /* Messages in send order: groups in order, each group's buffers shuffled. */
  void *req[MAX_REQ] = {0};
  int busy[MAX_REQ] = {0};
  size_t want[MAX_REQ];
  int g = 0, k = 0, done = 0, total = 0;
  for (int i = 0; i < nplan; i++) total += plan[i].n;
  while (done < total) {
    if (g < nplan) {
      int slot = -1;
      for (int i = 0; i < MAX_REQ; i++) if (!busy[i]) { slot = i; break; }
      if (slot >= 0) {
        int b = plan[g].order[k];
        size_t sz = plan[g].size[b];
        char *p = arena + (size_t)slot * SLOT;
        for (size_t i = 0; i < sz; i++) p[i] = (char)byte_of(g, b, i);
        void *r = NULL;
        CHECK(n_isend(n, s, p, sz, plan[g].tag[b], mh, &r) == 0, "v%d isend failed", n->v);
        if (r) {
          busy[slot] = 1; req[slot] = r; want[slot] = sz;
          if (++k == plan[g].n) { g++; k = 0; }
        }
      }
    }
    for (int i = 0; i < MAX_REQ; i++) {
      if (!busy[i]) continue;
      int d = 0, sz = -1;
      CHECK(TAIL(n, test)(req[i], &d, &sz) == 0, "v%d send test failed", n->v);
      if (d) {
        CHECK((size_t)sz == want[i], "v%d send completed with size %d, sent %zu", n->v, sz, want[i]);
        busy[i] = 0; done++;
      }
    }
  }
  return 0;
}

static int run_receiver(net_t *n, void *r, char *arena, void *mh) {
  int flushes = 0; /* iflush calls that returned a request to test */
  void *req[MAX_REQ] = {0};
  int grp[MAX_REQ], busy[MAX_REQ] = {0};
  int g = 0, done = 0;
  /* A group's buffers: slot i, buffer b at arena + i*MAX_RECVS*... (4 MiB each, buffers of one
   * group share a slot's region in 4 MiB / n pieces is not enough for 4 MiB messages, so each
   * buffer gets its own region: slot*MAX_RECVS + b). */
  while (done < nplan) {
    if (g < nplan) {
      int slot = -1;
      for (int i = 0; i < MAX_REQ; i++) if (!busy[i]) { slot = i; break; }
      if (slot >= 0) {
        void *ptrs[MAX_RECVS], *mhs[MAX_RECVS];
        size_t sizes[MAX_RECVS];
        for (int b = 0; b < plan[g].n; b++) {
          ptrs[b] = arena + ((size_t)slot * MAX_RECVS + b) * SLOT;
          memset(ptrs[b], 0xEE, plan[g].size[b] + 16);
          sizes[b] = plan[g].size[b] + 16; /* room to spare: the size reported must be exact */
          mhs[b] = mh;
        }
        void *q = NULL;
        CHECK(n_irecv(n, r, plan[g].n, ptrs, sizes, plan[g].tag, mhs, &q) == 0, "v%d irecv failed", n->v);
        if (q) { busy[slot] = 1; req[slot] = q; grp[slot] = g++; }
      }
    }
    for (int i = 0; i < MAX_REQ; i++) {
      if (!busy[i]) continue;
      int d = 0, sz[MAX_RECVS];
      for (int b = 0; b < MAX_RECVS; b++) sz[b] = -1;
      CHECK(TAIL(n, test)(req[i], &d, sz) == 0, "v%d recv test failed", n->v);
      if (!d) continue;
      int gi = grp[i];
      void *ptrs[MAX_RECVS], *mhs[MAX_RECVS];
      int isz[MAX_RECVS];
      for (int b = 0; b < plan[gi].n; b++) {
        unsigned char *p = (unsigned char *)arena + ((size_t)i * MAX_RECVS + b) * SLOT;
        CHECK((size_t)sz[b] == plan[gi].size[b], "v%d group %d buffer %d: size %d, want %zu", n->v, gi, b, sz[b], plan[gi].size[b]);
        for (size_t k = 0; k < plan[gi].size[b]; k++)
          CHECK(p[k] == byte_of(gi, b, k), "v%d group %d buffer %d byte %zu wrong", n->v, gi, b, k);
        CHECK(p[plan[gi].size[b]] == 0xEE, "v%d group %d buffer %d: written past its size", n->v, gi, b);
        ptrs[b] = p; mhs[b] = mh; isz[b] = sz[b];
      }
      /* iflush as NCCL does after a receive to GPU memory; for host memory it completes. */
      void *f = (void *)1;
      CHECK(TAIL(n, iflush)(r, plan[gi].n, ptrs, isz, mhs, &f) == 0, "v%d iflush failed", n->v);
      if (f) flushes++;
      while (f) {
        int fd = 0;
        CHECK(TAIL(n, test)(f, &fd, NULL) == 0, "v%d flush test failed", n->v);
        if (fd) break;
      }
      if (TAIL(n, irecvConsumed)) CHECK(TAIL(n, irecvConsumed)(r, plan[gi].n, req[i]) == 0, "v%d irecvConsumed", n->v);
      busy[i] = 0; done++;
    }
  }
  /* GPU memory is flushed by reads through the NIC that complete later; host memory never. */
  CHECK(reg_type == 2 ? flushes > 0 : flushes == 0, "v%d %d of the flushes returned a request (memory type %d)",
        n->v, flushes, reg_type);
  return 0;
}

static int misuse(net_t *n) {
  void *r = NULL;
  int d = 0, sz = 0;
  char buf[8];
  CHECK(n_isend(n, NULL, buf, 8, 1, NULL, &r) != 0, "v%d isend on a NULL comm succeeded", n->v);
  CHECK(TAIL(n, test)(NULL, &d, &sz) != 0, "v%d test(NULL) succeeded", n->v);
  CHECK(TAIL(n, test)((void *)0x12345601, &d, &sz) != 0, "v%d test of a foreign request succeeded", n->v);
  CHECK(TAIL(n, closeSend)(NULL) != 0, "v%d closeSend(NULL) succeeded", n->v);
  CHECK(TAIL(n, closeRecv)((void *)0x4242) != 0, "v%d closeRecv of garbage succeeded", n->v);
  int md = 0; size_t mp; char *nm;
  CHECK(n_props(n, 99, &md, &md, &mp, &nm) != 0, "v%d getProperties(99) succeeded", n->v);
  return 0;
}

static void *load(const char *lib) {
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) fprintf(stderr, "dlopen %s: %s\n", lib, dlerror());
  return h;
}

static int side(const char *lib, int v, int fd, int sender) {
  char sym[32];
  snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", v);
  void *h = load(lib);
  if (!h) return 1;
  net_t net = {v, dlsym(h, sym), NULL}, *n = &net;
  CHECK(n->tbl, "%s not exported", sym);
  CHECK(strcmp(*(const char **)n->tbl, "roccl") == 0, "%s name is not roccl", sym);
  CHECK(n_init(n) == 0, "v%d init failed", v);
  int nd = 0;
  CHECK(n_devices(n, &nd) == 0 && nd >= 1, "v%d devices: %d", v, nd);
  int maxRecvs = 0, ptr = 0; size_t maxp2p; char *name = NULL;
  CHECK(n_props(n, 0, &maxRecvs, &ptr, &maxp2p, &name) == 0, "v%d getProperties failed", v);
  CHECK(name && *name && maxRecvs >= 1 && maxRecvs <= MAX_RECVS && (ptr & 1) && maxp2p >= MAXMSG,
        "v%d properties: name %s maxRecvs %d ptrSupport %d maxP2pBytes %zu", v, name ? name : "(null)", maxRecvs, ptr, maxp2p);
  /* NCCL_PTR_DMABUF (4) comes with NCCL_PTR_CUDA (2): NCCL registers GPU buffers only then. */
  CHECK(!(ptr & 4) || (ptr & 2), "v%d ptrSupport %d: DMABUF without CUDA", v, ptr);
  reg_type = (ptr & 2) ? 2 : 1;
  make_plan(maxRecvs);
  char handle[HANDLE_SIZE];
  size_t arena_len = (size_t)MAX_REQ * MAX_RECVS * SLOT;
  char *arena;
  if (ptr & 4) {
    dmabuf_fd = memfd_create("harness-dmabuf", MFD_CLOEXEC);
    CHECK(dmabuf_fd >= 0 && ftruncate(dmabuf_fd, (off_t)arena_len) == 0, "memfd for the dmabuf arena");
    arena = mmap(NULL, arena_len, PROT_READ | PROT_WRITE, MAP_SHARED, dmabuf_fd, 0);
    CHECK(arena != MAP_FAILED, "mmap of the dmabuf arena");
    dmabuf_base = arena;
    if (!sender) { printf("   v%d: buffers are GPU memory registered through regMrDmaBuf (memfd)\n", v); fflush(stdout); }
  } else {
    arena = malloc(arena_len);
  }
  CHECK(arena, "out of memory");
  void *comm = NULL, *lcomm = NULL, *mh = NULL;
  if (!sender) {
    memset(handle, 0, sizeof handle);
    CHECK(n_listen(n, handle, &lcomm) == 0 && lcomm, "v%d listen failed", v);
    CHECK(write(fd, handle, sizeof handle) == (ssize_t)sizeof handle, "handle write");
    while (!comm) CHECK(n_accept(n, lcomm, &comm) == 0, "v%d accept failed", v);
  } else {
    CHECK(read(fd, handle, sizeof handle) == (ssize_t)sizeof handle, "handle read");
    while (!comm) CHECK(n_connect(n, handle, &comm) == 0, "v%d connect failed", v);
  }
  size_t span = sender ? (size_t)MAX_REQ * SLOT : (size_t)MAX_REQ * MAX_RECVS * SLOT;
  CHECK(n_regmr(n, comm, arena, span, &mh) == 0 && mh, "v%d regMr failed", v);
  void *mh2 = NULL;
  CHECK(n_regmr(n, comm, arena, span, &mh2) == 0 && mh2 == mh, "v%d regMr of the same range is not cached", v);
  CHECK(n_deregmr(n, comm, mh2) == 0, "v%d deregMr (shared) failed", v);
  if (!(ptr & 2)) {
    /* No GPU memory on this network: NCCL_PTR_CUDA and dmabuf registrations are refused. */
    void *mh3 = NULL;
    CHECK(T(net_v8_t)->regMr(comm, arena, span, 2, &mh3) != 0 && !mh3,
          "v%d regMr of NCCL_PTR_CUDA memory succeeded without GPU support", v);
    CHECK(T(net_v8_t)->regMrDmaBuf(comm, arena, span, 2, 0, 0, &mh3) != 0 && !mh3,
          "v%d regMrDmaBuf succeeded without dmabuf support", v);
    CHECK(T(net_v8_t)->regMrDmaBuf(comm, arena, span, 2, 0, -1, &mh3) != 0 && !mh3,
          "v%d regMrDmaBuf of fd -1 succeeded", v);
  }
  int rc = sender ? run_sender(n, comm, arena, mh) : run_receiver(n, comm, arena, mh);
  if (rc) return 1;
  CHECK(n_deregmr(n, comm, mh) == 0, "v%d deregMr failed", v);
  CHECK(n_deregmr(n, comm, mh) != 0, "v%d deregMr twice succeeded", v);
  if (sender) {
    CHECK(TAIL(n, closeSend)(comm) == 0, "v%d closeSend failed", v);
    CHECK(TAIL(n, closeSend)(comm) != 0, "v%d closeSend twice succeeded", v);
  } else {
    CHECK(TAIL(n, closeRecv)(comm) == 0, "v%d closeRecv failed", v);
    CHECK(TAIL(n, closeRecv)(comm) != 0, "v%d closeRecv twice succeeded", v);
    CHECK(TAIL(n, closeListen)(lcomm) == 0, "v%d closeListen failed", v);
  }
  if (misuse(n)) return 1;
  if (v >= 11) {
    CHECK(T(net_v11_t)->setNetAttr(n->ctx, NULL) == 0, "v%d setNetAttr failed", v);
    CHECK(T(net_v11_t)->finalize(n->ctx) == 0, "v%d finalize failed", v);
    CHECK(T(net_v11_t)->finalize(n->ctx) != 0, "v%d finalize twice succeeded", v);
  }
  CHECK(logged > 0, "v%d: nothing came through NCCL's logger", v);
  if (dmabuf_fd >= 0) {
    munmap(arena, arena_len);
    close(dmabuf_fd);
    dmabuf_fd = -1;
  } else {
    free(arena);
  }
  return 0;
}

/* ---- The loaders' lookup (harness --lookup LOADER EXPECT VERSION) --------------------------
 *
 * Finds the plugin from NCCL_NET_PLUGIN (as this process's environment has it) the way one
 * loader does, with dlopen(RTLD_NOW | RTLD_LOCAL) as the loaders call it; takes the first
 * ncclNetPlugin_vN the loader knows, newest first; calls the table's init and devices (the
 * loader goes on to the next entry of the list when the library is missing, has no version
 * it knows, or init/devices fail); and checks that the library it ended with is EXPECT (a
 * path: compared by directory, after resolving links, and file name, so each installed name
 * is checked itself even where one name links to another) or "none", at VERSION, named
 * "roccl". Prints every name tried.
 *
 * What the loaders do (read from their sources, reimplemented here; no loader code copied):
 *
 * NCCL 2.28 .. 2.30.7 (NVIDIA/nccl src/plugin/net.cc, initPluginLibsOnceFunc;
 * src/plugin/plugin_open.cc, openPluginLib/tryOpenLib; at v2.28.3-1 .. v2.30.7, 5067397c):
 *   - NCCL_NET_PLUGIN unset: one entry, "libnccl-net.so".
 *   - Set: "none" (any case) means the empty list; otherwise the value is split with
 *     strtok_r(",") (empty items vanish; at most NCCL_NET_MAX_PLUGINS - 2 = 14 entries;
 *     names of 255 characters or more are dropped). An empty value is an empty list (not the
 *     default): only NCCL's internal IB and Socket networks remain.
 *   - Each entry, in list order: dlopen(entry) as given (a path, or a file name that the
 *     dynamic linker searches: LD_LIBRARY_PATH, the cache, /lib, /usr/lib); if that fails and
 *     the entry has no '/' and is not "lib*.so", dlopen("libnccl-net-<entry>.so").
 *     ("STATIC_PLUGIN", or any case-insensitive prefix of it, dlopens the program itself;
 *     not reproduced here.)
 *   - In the library, ncclNetPlugin_v12, v11, ... v6 (2.28 and 2.29: from v11; src/plugin/
 *     net.cc ncclNetVersion[]); the first found is used; none: the next entry. Then init and
 *     devices (> 0); on failure the next entry. The first that works is used and the other
 *     external entries are disabled; the internal networks come after the list.
 * NCCL 2.27.5 .. 2.27.7: as 2.28, but "none" is not special (it is tried as a name, then as
 *   libnccl-net-none.so), and versions from v10.
 * NCCL 2.27.3: the list as above, but each entry is tried as given only if it looks like
 *   "lib?*.so" (at least 7 characters), else only as libnccl-net-<entry>.so: a full path
 *   (not starting with "lib") is never tried as given (src/plugin/plugin_open.cc at v2.27.3-1).
 * NCCL 2.26 (src/plugin/net.cc at v2.26.2-1: ncclOpenNetPluginLib(ncclGetEnv(...))): one
 *   value, not split; unset or empty: libnccl-net.so; else the value as given, then
 *   libnccl-net-<value>.so (always, even for a path); versions v10 .. v6.
 * RCCL of the rocm-systems tree (NCCL 2.29 merged; ROCm/rocm-systems
 *   projects/rccl/src/plugin/plugin_open.cc and net.cc at 03a89144): NCCL 2.28's rules with prefix
 *   "librccl-net" (pluginPrefix[NET]) and default "librccl-net.so" (defaultNetPlugin);
 *   versions v12 .. v6. Only the net plugin is renamed: RCCL's tuner/profiler/env keep
 *   libnccl-*.
 * RCCL of ROCm 6.3 (ROCm/rccl src/net.cc openNetPluginLib on release-staging/rocm-rel-6.3):
 *   one value, not split; unset or empty: librccl-net.so; else the value as given, then
 *   librccl-net-<value>.so; versions ncclNetPlugin_v8, v7, v6, v5 (v8 first).
 * RCCL of ROCm 5.1 .. 6.2 (ROCm/rccl src/net.cc ncclNetPluginInit at rocm-6.2.0, rocm-5.4.0,
 *   rocm-5.3.0): one value; unset or empty: librccl-net.so; else only librccl-net-<value>.so
 *   (never the value as given: no paths, no file names); ROCm 6.2 looks for v8 .. v5, ROCm
 *   5.4 .. 6.1 for v6 and v5 (so they cannot load roccl, which starts at v8), 5.1 .. 5.3 for
 *   v5. ROCm 5.0 (src/init.cc initNetPlugin) only ever opened librccl-net.so.
 * RCCL merges NCCL's sources, and NCCL's commits in RCCL's history carry libnccl-net names
 *   (ROCm/rccl src/net.cc at 1c7c014c, c4e2aa6c, d97a32fa, f9c3dc25, ab2b89c4, each put back
 *   to librccl-net by the following merge): hence both NCCL and RCCL names are installed.
 */
enum { AS_GIVEN_THEN_PREFIXED, CURRENT, V2_27_3, PREFIXED_ONLY };
typedef struct {
  const char *id, *what, *prefix;
  int split, none, empty_is_default, rule, newest, oldest;
} loader_t;
static const loader_t loaders[] = {
  {"nccl", "NCCL 2.30", "libnccl-net", 1, 1, 0, CURRENT, 12, 6},
  {"nccl-2.28", "NCCL 2.28/2.29", "libnccl-net", 1, 1, 0, CURRENT, 11, 6},
  {"nccl-2.27", "NCCL 2.27.5-2.27.7", "libnccl-net", 1, 0, 0, CURRENT, 10, 6},
  {"nccl-2.27.3", "NCCL 2.27.3", "libnccl-net", 1, 0, 0, V2_27_3, 10, 6},
  {"nccl-2.26", "NCCL 2.26", "libnccl-net", 0, 0, 1, AS_GIVEN_THEN_PREFIXED, 10, 6},
  {"rccl", "RCCL (rocm-systems)", "librccl-net", 1, 1, 0, CURRENT, 12, 6},
  {"rccl-6.3", "RCCL of ROCm 6.3", "librccl-net", 0, 0, 1, AS_GIVEN_THEN_PREFIXED, 8, 5},
  {"rccl-6.2", "RCCL of ROCm 6.2", "librccl-net", 0, 0, 1, PREFIXED_ONLY, 8, 5},
  {"rccl-6.1", "RCCL of ROCm 5.4-6.1", "librccl-net", 0, 0, 1, PREFIXED_ONLY, 6, 5},
};

static int is_lib_so(const char *s, size_t min) {
  size_t l = strlen(s);
  return l >= min && strncmp(s, "lib", 3) == 0 && strcmp(s + l - 3, ".so") == 0;
}

/* The names one entry is tried under, in order (at most 2). */
static int names_for(const loader_t *L, const char *entry, int is_default, char out[2][PATH_MAX]) {
  if (is_default) { snprintf(out[0], PATH_MAX, "%s.so", L->prefix); return 1; }
  int n = 0;
  int prefixed = 1;
  switch (L->rule) {
  case CURRENT:
    snprintf(out[n++], PATH_MAX, "%s", entry);
    prefixed = strchr(entry, '/') == NULL && !is_lib_so(entry, 3);
    break;
  case V2_27_3:
    if (is_lib_so(entry, strlen("libX.so"))) { snprintf(out[n++], PATH_MAX, "%s", entry); prefixed = 0; }
    break;
  case PREFIXED_ONLY:
    break;
  default:
    snprintf(out[n++], PATH_MAX, "%s", entry);
    break;
  }
  if (prefixed) snprintf(out[n++], PATH_MAX, "%s-%s.so", L->prefix, entry);
  return n;
}

/* Directory (links resolved) + "/" + file name. */
static void canon(const char *p, char *out) {
  char a[PATH_MAX], b[PATH_MAX], dir[PATH_MAX];
  snprintf(a, sizeof a, "%s", p);
  snprintf(b, sizeof b, "%s", p);
  if (!realpath(dirname(a), dir)) snprintf(dir, sizeof dir, "?");
  snprintf(out, 2 * PATH_MAX + 2, "%s/%s", dir, basename(b));
}

static char why[PATH_MAX + 64] = "empty list"; /* why the last entry was passed over */

/* 0: this entry gives a working plugin (*hp, *vp, path); 1: the loader goes on. */
static int try_entry(const loader_t *L, const char *entry, int is_default, void **hp, int *vp, char *path) {
  char names[2][PATH_MAX];
  int k = names_for(L, entry, is_default, names);
  void *h = NULL;
  for (int i = 0; i < k && !h; i++) {
    h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    printf("     dlopen(\"%s\"): %s\n", names[i], h ? "loaded" : "not found");
  }
  if (!h) { snprintf(why, sizeof why, "%s not found", names[k - 1]); return 1; }
  struct link_map *lm = NULL;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) != 0 || !lm) { dlclose(h); return 1; }
  snprintf(path, PATH_MAX, "%s", lm->l_name);
  net_t net = {0, NULL, NULL}, *n = &net;
  for (int v = L->newest; v >= L->oldest && !net.tbl; v--) {
    char sym[32];
    snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", v);
    net.tbl = dlsym(h, sym);
    net.v = v;
  }
  if (!net.tbl || net.v < 8) { /* roccl exports v8 .. v12 only */
    snprintf(why, sizeof why, "no ncclNetPlugin_v%d..v%d in it", L->newest, L->oldest);
    printf("     %s: %s: unsupported, next entry\n", path, why);
    dlclose(h);
    return 1;
  }
  int nd = 0;
  if (n_init(n) != 0 || n_devices(n, &nd) != 0 || nd <= 0) {
    snprintf(why, sizeof why, "ncclNetPlugin_v%d init/devices failed", net.v);
    printf("     %s: %s, next entry\n", path, why);
    return 1;
  }
  printf("     %s: ncclNetPlugin_v%d \"%s\", init ok, %d device(s)\n", path, net.v, *(const char **)net.tbl, nd);
  if (net.v >= 11) T(net_v11_t)->finalize(n->ctx);
  *hp = net.tbl;
  *vp = net.v;
  return 0;
}

static int lookup_main(int argc, char **argv) {
  if (argc != 5) { fprintf(stderr, "usage: harness --lookup LOADER EXPECT(path|none) VERSION\n"); return 2; }
  setvbuf(stdout, NULL, _IONBF, 0); /* the trace before a FAIL line */
  const loader_t *L = NULL;
  for (size_t i = 0; i < sizeof loaders / sizeof loaders[0]; i++)
    if (strcmp(loaders[i].id, argv[2]) == 0) L = &loaders[i];
  if (!L) { fprintf(stderr, "unknown loader %s\n", argv[2]); return 2; }
  const char *expect = argv[3];
  int want_v = atoi(argv[4]);
  const char *env = getenv("NCCL_NET_PLUGIN");
  printf("   %-12s NCCL_NET_PLUGIN=%s%s%s (%s)\n", L->id, env ? "\"" : "", env ? env : "(unset)", env ? "\"" : "", L->what);
  void *tbl = NULL;
  int v = 0;
  char path[PATH_MAX] = "";
  if (!env || (!*env && L->empty_is_default)) {
    try_entry(L, NULL, 1, &tbl, &v, path);
  } else if (!(L->none && strcasecmp(env, "none") == 0)) {
    char *list = strdup(env), *save = NULL;
    int count = 0;
    for (char *e = L->split ? strtok_r(list, ",", &save) : list; e && !tbl; e = L->split ? strtok_r(NULL, ",", &save) : NULL) {
      if (!*e) break; /* an unsplit empty value (only the unsplit loaders get here) */
      if (++count > 14) break;
      if (strlen(e) + 1 > 255) continue;
      try_entry(L, e, 0, &tbl, &v, path);
    }
    free(list);
  }
  if (!tbl) {
    printf("     -> no external plugin (%s): %s's internal networks\n", why, L->id);
    if (strcmp(expect, "none") == 0) return 0;
    fprintf(stderr, "FAIL: %s with NCCL_NET_PLUGIN=%s did not find %s\n", L->id, env ? env : "(unset)", expect);
    return 1;
  }
  char got[2 * PATH_MAX + 2], want[2 * PATH_MAX + 2];
  canon(path, got);
  if (strcmp(expect, "none") == 0) {
    fprintf(stderr, "FAIL: %s with NCCL_NET_PLUGIN=%s loaded %s, wanted none\n", L->id, env ? env : "(unset)", got);
    return 1;
  }
  canon(expect, want);
  if (strcmp(got, want) != 0 || v != want_v || strcmp(*(const char **)tbl, "roccl") != 0) {
    fprintf(stderr, "FAIL: %s with NCCL_NET_PLUGIN=%s: got %s ncclNetPlugin_v%d \"%s\", wanted %s ncclNetPlugin_v%d \"roccl\"\n",
            L->id, env ? env : "(unset)", got, v, *(const char **)tbl, want, want_v);
    return 1;
  }
  printf("     -> %s, ncclNetPlugin_v%d, as expected\n", got, v);
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--lookup") == 0) return lookup_main(argc, argv);
  const char *lib = argc > 1 ? argv[1] : "libnccl-net-roccl.so";
  alarm(120);
  void *h = load(lib);
  if (!h) return 1;
  int found = 0;
  for (int v = 12; v >= 6 && !found; v--) { /* NCCL's lookup order */
    char sym[32];
    snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", v);
    if (dlsym(h, sym)) { printf("-- %s: NCCL would load %s\n", lib, sym); found = v; }
  }
  if (found != 12) { fprintf(stderr, "FAIL: NCCL would not find ncclNetPlugin_v12\n"); return 1; }
  dlclose(h);
  fflush(stdout);
  for (int v = 12; v >= 8; v--) {
    /* Two fresh processes per version, as two ranks: neither inherits the other's plugin
     * state (a forked copy of an initialized plugin would share its sockets). */
    int p[2];
    if (pipe(p)) return 1;
    pid_t pid[2];
    for (int sender = 0; sender < 2; sender++) {
      pid[sender] = fork();
      if (pid[sender] == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* no orphan spins on if the harness is killed */
        alarm(120);                       /* alarms are not inherited across fork */
        close(p[sender ? 1 : 0]);
        _exit(side(lib, v, p[sender ? 0 : 1], sender) || failures ? 1 : 0);
      }
    }
    close(p[0]);
    close(p[1]);
    int ok[2];
    for (int i = 0; i < 2; i++) {
      int st = 0;
      waitpid(pid[i], &st, 0);
      ok[i] = WIFEXITED(st) && WEXITSTATUS(st) == 0;
    }
    if (!ok[0] || !ok[1]) {
      fprintf(stderr, "FAIL: v%d (receiver %s, sender %s)\n", v, ok[0] ? "ok" : "failed", ok[1] ? "ok" : "failed");
      return 1;
    }
    printf("-- v%d: %d messages (0 B .. 4 MiB, grouped receives up to %d, 32 in flight) ok; misuse refused\n", v, MSGS, MAX_RECVS);
    fflush(stdout);
  }
  return 0;
}
