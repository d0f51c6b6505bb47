// A process's malloc family served by glibc's allocator even where the program is linked with
// another (the nebula binary links jemalloc): LD_PRELOAD it to compare the two on the same binary
// (bench/zero.sh ALLOCATOR=glibc). Each function forwards to glibc's own entry point.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>

extern void* __libc_malloc(size_t);
extern void __libc_free(void*);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void* __libc_valloc(size_t);
extern void* __libc_pvalloc(size_t);

void* malloc(size_t n) { return __libc_malloc(n); }
void free(void* p) { __libc_free(p); }
void* calloc(size_t n, size_t m) { return __libc_calloc(n, m); }
void* realloc(void* p, size_t n) { return __libc_realloc(p, n); }
void* memalign(size_t a, size_t n) { return __libc_memalign(a, n); }
void* aligned_alloc(size_t a, size_t n) { return __libc_memalign(a, n); }
void* valloc(size_t n) { return __libc_valloc(n); }
void* pvalloc(size_t n) { return __libc_pvalloc(n); }
int posix_memalign(void** out, size_t a, size_t n) {
  if (a % sizeof(void*) != 0 || (a & (a - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(a, n);
  if (!p && n) return ENOMEM;
  *out = p;
  return 0;
}
size_t malloc_usable_size(void* p) {  // glibc's own, not the linked allocator's
  static size_t (*libc)(void*);
  if (!libc) libc = (size_t (*)(void*))dlsym(dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD), "malloc_usable_size");
  return libc(p);
}
