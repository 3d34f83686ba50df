// Yardsticks for BENCHMARKS.md, "The 1 GiB fan-out, regressed and mended" (issue 41):
// 1 GiB into fresh memory several ways (anonymous 4 KiB / THP, a memory file by
// pwrite, through a fresh shared mapping, through a MAP_POPULATE mapping), a rank's
// read of a sealed file with and without MAP_POPULATE, and whether MFD_HUGETLB can be
// backed. Build and run: cc -O2 -o /tmp/memfd_fill benchmarks/memfd_fill.c && /tmp/memfd_fill
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>
#include <sys/resource.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
static long flt(){struct rusage r;getrusage(RUSAGE_SELF,&r);return r.ru_minflt;}
static void warm(size_t n){char*p=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);memset(p,1,n);munmap(p,n);}
int main(){size_t n=(size_t)1<<30;char*src=malloc(n);memset(src,7,n);
for(int rep=0;rep<3;rep++){double t;long f;char*m;int fd;
 for(int huge=0;huge<2;huge++){warm(2*n);t=now();f=flt();m=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);if(huge)madvise(m,n,MADV_HUGEPAGE);memcpy(m,src,n);printf("memcpy fresh anon %s: %.0f ms, %ld faults\n",huge?"THP":"4K",now()-t,flt()-f);munmap(m,n);}
 warm(2*n);t=now();f=flt();fd=memfd_create("a",MFD_ALLOW_SEALING);ftruncate(fd,n);for(size_t o=0;o<n;){ssize_t w=pwrite(fd,src+o,n-o,o);o+=w;}printf("memfd pwrite: %.0f ms, %ld faults\n",now()-t,flt()-f);
 fcntl(fd,F_ADD_SEALS,F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW);
 for(int pop=0;pop<2;pop++){t=now();f=flt();m=mmap(0,n,PROT_READ,MAP_SHARED|(pop?MAP_POPULATE:0),fd,0);unsigned long s=0;for(size_t i=0;i<n;i+=4096)s+=m[i];printf("rank read one word per page%s: %.0f ms, %ld faults (%lu)\n",pop?" (MAP_POPULATE)":"",now()-t,flt()-f,s);munmap(m,n);}
 close(fd);
 warm(2*n);t=now();f=flt();fd=memfd_create("b",MFD_ALLOW_SEALING);ftruncate(fd,n);m=mmap(0,n,PROT_READ|PROT_WRITE,MAP_SHARED,fd,0);memcpy(m,src,n);munmap(m,n);printf("memfd via fresh mapping: %.0f ms, %ld faults\n",now()-t,flt()-f);close(fd);
 warm(2*n);t=now();f=flt();fd=memfd_create("c",MFD_ALLOW_SEALING);ftruncate(fd,n);m=mmap(0,n,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_POPULATE,fd,0);memcpy(m,src,n);munmap(m,n);printf("memfd via MAP_POPULATE mapping: %.0f ms, %ld faults\n",now()-t,flt()-f);close(fd);
 fd=memfd_create("h",MFD_HUGETLB);printf("MFD_HUGETLB: %s\n", fd<0?"refused":(ftruncate(fd,n)==0&&mmap(0,n,PROT_READ|PROT_WRITE,MAP_SHARED,fd,0)!=MAP_FAILED?"ok":"no huge pages to back it"));if(fd>=0)close(fd);
}}
