/* How fast can a 1 GiB payload get into a memory file?  mode 0: write(); mode 1:
 * fallocate() then pwrite(); mode 2 is skipped (mmap MAP_POPULATE + memcpy, run by
 * removing the skip); and malloc + memcpy as the yardstick. Each step is preceded by
 * touching 2 GiB (see BENCHMARKS.md, "Method").
 * Build and run: gcc -O2 -o /tmp/shmem_write benchmarks/shmem_write.c && /tmp/shmem_write */
#define _GNU_SOURCE
#include <sys/mman.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
static void warm(size_t n){char*p=malloc(n);memset(p,1,n);free(p);}
int main(){
  size_t n=(size_t)1<<30; char*src=malloc(n); memset(src,7,n);
  for(int rep=0;rep<6;rep++){
   for(int mode=0;mode<4;mode++){ if(mode==2) continue;
    warm(2*n);
    double t=now();
    if(mode==3){ char*d=malloc(n); memcpy(d,src,n); double tt=now()-t; printf("rep %d anon memcpy %.0f ms\n",rep,tt); free(d); continue;}
    int fd=memfd_create("x",MFD_ALLOW_SEALING);
    if(mode==0){ size_t off=0; while(off<n){ssize_t w=write(fd,src+off,n-off); if(w<=0)return 1; off+=w;} }
    if(mode==1){ double a=now(); fallocate(fd,0,0,n); printf("  fallocate %.0f ms\n", now()-a); size_t off=0; while(off<n){ssize_t w=pwrite(fd,src+off,n-off,off); if(w<=0)return 1; off+=w;} }
    if(mode==2){ ftruncate(fd,n); char*p=mmap(NULL,n,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_POPULATE,fd,0); memcpy(p,src,n); munmap(p,n);}
    double tt=now()-t;
    printf("rep %d mode %d %.0f ms\n",rep,mode,tt);
    close(fd);
   }
  }
}
