package localcluster

import (
	"io"
	"net"
	"sync"
)

// Proxy is a TCP proxy on loopback between components and the API server. Cut closes every
// connection through it (watches break, as when a load balancer or network drops them); new
// connections work at once. Block cuts them and refuses new ones until Unblock (a partition).
type Proxy struct {
	Addr     string
	upstream string
	l        net.Listener

	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	blocked bool
}

// NewProxy listens on a free loopback port and forwards to upstream (host:port).
func NewProxy(upstream string) (*Proxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{Addr: l.Addr().String(), upstream: upstream, l: l, conns: map[net.Conn]struct{}{}}
	go p.serve()
	return p, nil
}

func (p *Proxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		go p.handle(c)
	}
}

func (p *Proxy) handle(c net.Conn) {
	p.mu.Lock()
	blocked := p.blocked
	p.mu.Unlock()
	if blocked {
		c.Close()
		return
	}
	u, err := net.Dial("tcp", p.upstream)
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	p.conns[c], p.conns[u] = struct{}{}, struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(u, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, u); done <- struct{}{} }()
	<-done
	c.Close()
	u.Close()
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, u)
	p.mu.Unlock()
}

// Cut closes every open connection and returns how many client connections it cut.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.conns) / 2
	for c := range p.conns {
		c.Close()
	}
	return n
}

// Block cuts every connection and refuses new ones until Unblock: the components behind the
// proxy are cut off from the API server.
func (p *Proxy) Block() int {
	p.mu.Lock()
	p.blocked = true
	p.mu.Unlock()
	return p.Cut()
}

// Unblock lets new connections through again.
func (p *Proxy) Unblock() {
	p.mu.Lock()
	p.blocked = false
	p.mu.Unlock()
}

// Close stops the proxy and closes its connections.
func (p *Proxy) Close() {
	p.l.Close()
	p.Cut()
}
