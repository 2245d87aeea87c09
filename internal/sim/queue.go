package sim

import "time"

// eventKind says what an event does when its time comes.
type eventKind uint8

const (
	evPodBind      eventKind = iota // a pod is bound to its node (the agent counts it as demand)
	evPodAdd                        // the pod's CNI ADD reaches the agent
	evPodStop                       // the pod stops: DEL
	evArrival                       // the next synthetic pod of a node is bound
	evAgentWritten                  // an agent's spec write returns
	evSpecArrive                    // an agent's spec write reaches the controller's informer
	evOpDone                        // an operation of the controller lands (b: its ID)
	evStatusArrive                  // a node status write reaches the node's agent
	evPoolFlag                      // a pool status write with a new exhausted flag reaches the agents
	evMachineWake                   // the controller's machine asked to be woken
	evAgentResync                   // a node agent's periodic recomputation
	evCooled                        // a node agent's machine asked to be woken (an ADD's deadline, a cooling address)
	evAgentWake                     // a node's release delay ends or a counted cooling address cools: the monitor's round
	evTraceNext                     // the next trace event is due
	evSample                        // take a time-series sample
)

// event is one entry of the simulation's agenda. a and b are the kind's arguments (a node, a
// pod, a worker, a generation).
type event struct {
	at   time.Duration
	seq  uint64
	kind eventKind
	a    int32
	b    int64
}

// agenda is a min-heap of events by time, then by the order they were scheduled, so a run is
// deterministic. It is hand-written to keep events unboxed.
type agenda struct {
	h   []event
	seq uint64
}

func (q *agenda) len() int { return len(q.h) }

func (q *agenda) less(i, j int) bool {
	if q.h[i].at != q.h[j].at {
		return q.h[i].at < q.h[j].at
	}
	return q.h[i].seq < q.h[j].seq
}

// push schedules an event.
func (q *agenda) push(at time.Duration, kind eventKind, a int32, b int64) {
	q.seq++
	q.h = append(q.h, event{at: at, seq: q.seq, kind: kind, a: a, b: b})
	i := len(q.h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !q.less(i, p) {
			break
		}
		q.h[i], q.h[p] = q.h[p], q.h[i]
		i = p
	}
}

// pop removes and returns the earliest event; the agenda must not be empty.
func (q *agenda) pop() event {
	top := q.h[0]
	last := len(q.h) - 1
	q.h[0] = q.h[last]
	q.h = q.h[:last]
	i := 0
	for {
		l := 2*i + 1
		if l >= last {
			break
		}
		m := l
		if r := l + 1; r < last && q.less(r, l) {
			m = r
		}
		if !q.less(m, i) {
			break
		}
		q.h[i], q.h[m] = q.h[m], q.h[i]
		i = m
	}
	return top
}

// peek returns the time of the earliest event; the agenda must not be empty.
func (q *agenda) peek() time.Duration { return q.h[0].at }

// tokenBucket is a client-side rate limiter in virtual time, as client-go's: a request takes a
// token, and when none is left it waits for the next one. Reservations may run into the future.
type tokenBucket struct {
	qps, burst float64
	tokens     float64
	last       time.Duration
}

func newTokenBucket(qps float64, burst int) *tokenBucket {
	return &tokenBucket{qps: qps, burst: float64(burst), tokens: float64(burst)}
}

// take reserves a token at now and returns when the request may go out (now when no limit).
func (b *tokenBucket) take(now time.Duration) time.Duration {
	if b.qps <= 0 {
		return now
	}
	if now > b.last {
		b.tokens = min(b.burst, b.tokens+(now-b.last).Seconds()*b.qps)
		b.last = now
	}
	b.tokens--
	if b.tokens >= 0 {
		return now
	}
	return now + time.Duration(-b.tokens/b.qps*float64(time.Second))
}
