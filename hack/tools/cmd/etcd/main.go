// Command etcd is a minimal etcd server around go.etcd.io/etcd/server/v3/embed,
// enough to back a test kube-apiserver on loopback.
package main

import (
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"

	"go.etcd.io/etcd/server/v3/embed"
)

func main() {
	dataDir := flag.String("data-dir", "", "data directory (required)")
	clientURL := flag.String("listen-client-urls", "http://127.0.0.1:2379", "client URL")
	peerURL := flag.String("listen-peer-urls", "http://127.0.0.1:2380", "peer URL")
	noFsync := flag.Bool("unsafe-no-fsync", false, "skip fsync (tests only)")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("--data-dir is required")
	}
	cu, err := url.Parse(*clientURL)
	if err != nil {
		log.Fatalf("--listen-client-urls: %v", err)
	}
	pu, err := url.Parse(*peerURL)
	if err != nil {
		log.Fatalf("--listen-peer-urls: %v", err)
	}
	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*cu}
	cfg.AdvertiseClientUrls = []url.URL{*cu}
	cfg.ListenPeerUrls = []url.URL{*pu}
	cfg.AdvertisePeerUrls = []url.URL{*pu}
	cfg.InitialCluster = cfg.Name + "=" + pu.String()
	cfg.UnsafeNoFsync = *noFsync
	cfg.LogLevel = "error"
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("start etcd: %v", err)
	}
	<-e.Server.ReadyNotify()
	log.Printf("etcd ready on %s", cu)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case <-sig:
	case err := <-e.Err():
		log.Printf("etcd error: %v", err)
	}
	e.Close()
}
