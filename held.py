import sys, threading, time; sys.path.insert(0,'/tmp/r7'); from raw import send, short
K=sys.argv[1]; P1=int(sys.argv[2]); P2=int(sys.argv[3]); who=sys.argv[4] if len(sys.argv)>4 else 'alice'
res={}
def first(): res['first']=send(P1, ['Authorization: Bearer alice', 'Idempotency-Key: '+K], path='/x?sleep=2')
t=threading.Thread(target=first); t.start(); time.sleep(0.5)
t0=time.time(); r=send(P2, ['Authorization: Bearer '+who, 'Idempotency-Key: '+K], path='/x?sleep=2'); print('dup', who, round(time.time()-t0,2), short(r)[:230])
t.join(); print('first', short(res['first'])[:160])
for i in range(2): print('retry', short(send(P2, ['Authorization: Bearer '+who, 'Idempotency-Key: '+K], path='/x?sleep=2'))[:200])
