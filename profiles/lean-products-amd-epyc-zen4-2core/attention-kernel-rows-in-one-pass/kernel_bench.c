/* kernel_bench.sh builds this against the kernel before (ref_decode_attention) and after (ab_decode_attention). */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <math.h>
void ab_decode_attention(const void *q, const void *k_cache, const void *v_cache, int md, const int64_t *tables,
                         int64_t table_stride, const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale, void *out, int od, int bf, int threads);
void ref_decode_attention(const void *q, const void *k_cache, const void *v_cache, int md, const int64_t *tables,
                         int64_t table_stride, const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale, void *out, int od, int bf, int threads);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv){
  int64_t B=atoi(argv[1]), L=atoi(argv[2]); int md=atoi(argv[3]); int reps=atoi(argv[4]); int th = argc > 5 ? atoi(argv[5]) : 1;
  int64_t H=9,KVH=3,D=64,bs=16, nb=(L+bs-1)/bs;
  int64_t blocks=B*nb+1; size_t es = md?2:4;
  void *k=malloc(blocks*bs*KVH*D*es), *v=malloc(blocks*bs*KVH*D*es), *q=malloc(B*H*D*es);
  float *o1=malloc(B*H*D*4), *o2=malloc(B*H*D*4);
  srand(1);
  for(size_t i=0;i<blocks*bs*KVH*D;i++){ float a=(rand()/(float)RAND_MAX-0.5f)*2, b=(rand()/(float)RAND_MAX-0.5f)*2;
    if(md){uint32_t u; memcpy(&u,&a,4); ((uint16_t*)k)[i]=u>>16; memcpy(&u,&b,4); ((uint16_t*)v)[i]=u>>16;} else {((float*)k)[i]=a; ((float*)v)[i]=b;}}
  for(size_t i=0;i<B*H*D;i++){float a=(rand()/(float)RAND_MAX-0.5f)*4; if(md){uint32_t u; memcpy(&u,&a,4); ((uint16_t*)q)[i]=u>>16;} else ((float*)q)[i]=a;}
  int64_t *tab=malloc(B*nb*8), *ctx=malloc(B*8);
  for(int64_t b=0;b<B;b++){ctx[b]=L; for(int64_t j=0;j<nb;j++) tab[b*nb+j]=1+((b*nb+j)*7919)%(B*nb);}
  float scale=0.125f;
  ab_decode_attention(q,k,v,md,tab,nb,ctx,B,H,KVH,D,bs,scale,o1,0,md,th);
  ref_decode_attention(q,k,v,md,tab,nb,ctx,B,H,KVH,D,bs,scale,o2,0,md,th);
  double md_=0; for(int64_t i=0;i<B*H*D;i++){double d=fabs(o1[i]-o2[i]); if(d>md_) md_=d;}
  double best1=1e9,best2=1e9;
  for(int r=0;r<reps;r++){double t=now(); ab_decode_attention(q,k,v,md,tab,nb,ctx,B,H,KVH,D,bs,scale,o1,0,md,th); t=now()-t; if(t<best1)best1=t;
    t=now(); ref_decode_attention(q,k,v,md,tab,nb,ctx,B,H,KVH,D,bs,scale,o2,0,md,th); t=now()-t; if(t<best2)best2=t;}
  double per=1e9/(B*KVH*L);
  printf("rows %ld ctx %ld %s: after %.2f ms (%.1f ns a row, KV head and position)  before %.2f ms (%.1f ns)  after/before %.3f  max difference %.2e\n",(long)B,(long)L,md?"bf16":"f32",best1*1e3,best1*per,best2*1e3,best2*per,best1/best2,md_);
}
