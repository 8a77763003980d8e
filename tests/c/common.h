/* Helpers shared by the C tests: checks, value encoding per data type, forked ranks. */
#ifndef ROCCL_TEST_COMMON_H_
#define ROCCL_TEST_COMMON_H_

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "roccl.h"

#define CHECK(call)                                                                      \
  do {                                                                                   \
    rocclResult_t r_ = (call);                                                           \
    if (r_ != rocclSuccess) {                                                            \
      fprintf(stderr, "%s:%d: %s -> %d (%s): %s\n", __FILE__, __LINE__, #call, (int)r_,  \
              rocclGetErrorString(r_), rocclGetLastError(NULL));                         \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

#define EXPECT(cond, ...)                                            \
  do {                                                               \
    if (!(cond)) {                                                   \
      fprintf(stderr, "%s:%d: expected %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                  \
      fprintf(stderr, "\n");                                         \
      exit(1);                                                       \
    }                                                                \
  } while (0)

static inline size_t type_size(rocclDataType_t t) {
  switch (t) {
    case rocclInt8: case rocclUint8: return 1;
    case rocclFloat16: case rocclBfloat16: return 2;
    case rocclInt32: case rocclUint32: case rocclFloat32: return 4;
    default: return 8;
  }
}

static inline int is_float(rocclDataType_t t) {
  return t == rocclFloat16 || t == rocclBfloat16 || t == rocclFloat32 || t == rocclFloat64;
}

static inline int is_signed(rocclDataType_t t) {
  return is_float(t) || t == rocclInt8 || t == rocclInt32 || t == rocclInt64;
}

static inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
  uint32_t man = x & 0x7fffff;
  if (f == 0.0f) return (uint16_t)sign;
  if (exp <= 0 || exp >= 31) return (uint16_t)(sign | 0x7c00); /* tests stay in range */
  uint32_t h = sign | ((uint32_t)exp << 10) | (man >> 13);
  uint32_t rest = man & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
  return (uint16_t)h;
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, x;
  if (exp == 0) {
    float v = ldexpf((float)man, -24);
    return sign ? -v : v;
  }
  if (exp == 31) x = sign | 0x7f800000 | (man << 13);
  else x = sign | ((exp - 15 + 127) << 23) | (man << 13);
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static inline void set_val(rocclDataType_t t, void* buf, size_t i, double v) {
  char* p = (char*)buf + i * type_size(t);
  switch (t) {
    case rocclInt8: { int8_t x = (int8_t)v; memcpy(p, &x, 1); break; }
    case rocclUint8: { uint8_t x = (uint8_t)v; memcpy(p, &x, 1); break; }
    case rocclInt32: { int32_t x = (int32_t)v; memcpy(p, &x, 4); break; }
    case rocclUint32: { uint32_t x = (uint32_t)v; memcpy(p, &x, 4); break; }
    case rocclInt64: { int64_t x = (int64_t)v; memcpy(p, &x, 8); break; }
    case rocclUint64: { uint64_t x = (uint64_t)v; memcpy(p, &x, 8); break; }
    case rocclFloat16: { uint16_t x = f32_to_f16((float)v); memcpy(p, &x, 2); break; }
    case rocclBfloat16: { float f = (float)v; uint32_t b; memcpy(&b, &f, 4); uint16_t x = (uint16_t)(b >> 16); memcpy(p, &x, 2); break; }
    case rocclFloat32: { float x = (float)v; memcpy(p, &x, 4); break; }
    default: { double x = v; memcpy(p, &x, 8); break; }
  }
}

static inline double get_val(rocclDataType_t t, const void* buf, size_t i) {
  const char* p = (const char*)buf + i * type_size(t);
  switch (t) {
    case rocclInt8: { int8_t x; memcpy(&x, p, 1); return x; }
    case rocclUint8: { uint8_t x; memcpy(&x, p, 1); return x; }
    case rocclInt32: { int32_t x; memcpy(&x, p, 4); return x; }
    case rocclUint32: { uint32_t x; memcpy(&x, p, 4); return x; }
    case rocclInt64: { int64_t x; memcpy(&x, p, 8); return (double)x; }
    case rocclUint64: { uint64_t x; memcpy(&x, p, 8); return (double)x; }
    case rocclFloat16: { uint16_t x; memcpy(&x, p, 2); return f16_to_f32(x); }
    case rocclBfloat16: { uint16_t x; memcpy(&x, p, 2); uint32_t b = (uint32_t)x << 16; float f; memcpy(&f, &b, 4); return f; }
    case rocclFloat32: { float x; memcpy(&x, p, 4); return x; }
    default: { double x; memcpy(&x, p, 8); return x; }
  }
}

/* Input element i of rank r: small integers, exact in every type. */
static inline double val(rocclDataType_t t, rocclRedOp_t op, int r, size_t i) {
  if (op == rocclProd) return 1 + (r + (int)i) % 2;
  double v = (double)((r * 5 + (int)(i % 1000) * 3) % 7);
  return is_signed(t) ? v - 2 : v;
}

static inline double reduced(rocclDataType_t t, rocclRedOp_t op, int n, size_t i) {
  double acc = val(t, op, 0, i);
  for (int r = 1; r < n; r++) {
    double v = val(t, op, r, i);
    switch (op) {
      case rocclSum: case rocclAvg: acc += v; break;
      case rocclProd: acc *= v; break;
      case rocclMax: acc = v > acc ? v : acc; break;
      default: acc = v < acc ? v : acc; break;
    }
  }
  if (op == rocclAvg) acc = is_float(t) ? acc / n : trunc(acc / n);
  return acc;
}

static inline int close_to(rocclDataType_t t, double got, double want) {
  double tol = (t == rocclFloat16 || t == rocclBfloat16) ? 1e-2 * fabs(want) + 1e-3
               : (t == rocclFloat32) ? 1e-6 * fabs(want) : 0.0;
  return fabs(got - want) <= tol;
}

/* Fork n ranks running body(rank, n, id); returns the number of ranks that failed. */
static inline int run_forked(int n, void (*body)(int, int, rocclUniqueId)) {
  rocclUniqueId id;
  CHECK(rocclGetUniqueId(&id));
  fflush(NULL);
  pid_t pids[64];
  for (int r = 0; r < n; r++) {
    pid_t p = fork();
    if (p == 0) {
      body(r, n, id);
      fflush(NULL);
      _exit(0);
    }
    pids[r] = p;
  }
  int failed = 0;
  for (int r = 0; r < n; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "rank %d failed (status %d)\n", r, st);
      failed++;
    }
  }
  return failed;
}

#endif
