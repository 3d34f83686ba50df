/* What does a rank pay to read a 1 GiB memory file?  mode 0: plain mapping, faulted in
 * by touching every page; mode 1: MAP_POPULATE; mode 2: MADV_POPULATE_READ. Then a
 * read of every word, and munmap.
 * Build and run: gcc -O2 -o /tmp/map_read benchmarks/map_read.c && /tmp/map_read */
#define _GNU_SOURCE
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
int main(int argc,char**argv){
  size_t n=(size_t)1<<30; char*src=malloc(n); memset(src,7,n);
  for(int rep=0;rep<3;rep++){
  int fd=memfd_create("x",MFD_ALLOW_SEALING);
  double t=now(); size_t off=0; while(off<n){ssize_t w=write(fd,src+off,n-off); if(w<=0)return 1; off+=w;} double tw=now()-t;
  for(int mode=0;mode<3;mode++){
    t=now();
    int flags=MAP_SHARED|(mode==1?MAP_POPULATE:0);
    volatile unsigned char*p=mmap(NULL,n,PROT_READ,flags,fd,0);
    if(mode==2) madvise((void*)p,n,22 /*MADV_POPULATE_READ*/);
    double tm=now()-t;
    unsigned long s=0; t=now(); for(size_t i=0;i<n;i+=4096) s+=p[i]; double tt=now()-t;
    t=now(); const unsigned long*q=(const unsigned long*)p; unsigned long h=0; for(size_t i=0;i<n/8;i++) h^=q[i]*0x100000001b3UL; double th=now()-t;
    t=now(); munmap((void*)p,n); double tu=now()-t;
    printf("rep %d write %.0f ms | mode %d map %.1f touch %.1f hash %.1f unmap %.1f (%lu %lu)\n",rep,tw,mode,tm,tt,th,tu,s,h);
  }
  close(fd);
  }
}
