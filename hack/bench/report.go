package main

import (
	"bytes"
	"fmt"
	"runtime"
	"slices"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/ipwarden/ipwarden/internal/charts"
)

// report is what a bench run measured: the figures of its text table and the samples its
// pictures draw. The pictures are drawn from these samples and nothing else, and the figures
// that name the same quantities are computed from them too (cniPooled, burstFigures).
type report struct {
	date    time.Time
	figures []figure
	// cni is every ADD+DEL pair's time of the cni section's paired runs, by plugin
	// ("ipwarden", "host-local"); nil when the section did not run.
	cni map[string][]time.Duration
	// burst is every ADD of the burst section, by node.
	burst map[string][]burstADD
}

// burstADD is one ADD of a burst: when it was sent, after the burst's first, and how long the
// plugin took to answer it (its IP wait, as the burst's figures count it); 0 if it failed.
type burstADD struct{ at, wait time.Duration }

// cniPooled is the figure the CNI picture shows in numbers: p50 and p99 of every pair of every
// run, by plugin, pooled (the goals are judged per run, on the median of the runs' ratios).
func cniPooled(lat map[string][]time.Duration) figure {
	ipw, hl := lat["ipwarden"], lat["host-local"]
	return figure{
		name: fmt.Sprintf("CNI ADD+DEL p50 / p99 over all %d pairs of the runs, pooled (the picture)", len(ipw)),
		value: fmt.Sprintf("ipwarden %s / %s, host-local %s / %s",
			quantile(ipw, 0.5).Round(10*time.Microsecond), quantile(ipw, 0.99).Round(10*time.Microsecond),
			quantile(hl, 0.5).Round(10*time.Microsecond), quantile(hl, 0.99).Round(10*time.Microsecond)),
		goal: "(informational)", ok: true,
	}
}

// text is the report as `make bench` prints it: the machine, then one row per figure.
func (r *report) text() string {
	var b bytes.Buffer
	fmt.Fprintf(&b, "ipwarden bench: %d CPUs, %s/%s, %s, everything on loopback of this machine\n", runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, r.date.UTC().Format("2006-01-02"))
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FIGURE\tVALUE\tGOAL\tMET")
	for _, f := range r.figures {
		met := "yes"
		if !f.ok {
			met = "NO"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", f.name, f.value, f.goal, met)
	}
	_ = tw.Flush()
	return b.String()
}

func (r *report) failed() int {
	n := 0
	for _, f := range r.figures {
		if !f.ok {
			n++
		}
	}
	return n
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// charts are the pictures of what ran: the CNI pairs' time distribution, ipwarden against
// host-local, and each burst ADD's IP wait over the burst, by node.
func (r *report) charts() []charts.Chart {
	var out []charts.Chart
	if len(r.cni) > 0 {
		c := charts.Chart{File: "cni-latency.svg",
			Title:  "CNI ADD+DEL pair time, ipwarden against host-local (make bench, cni)",
			XLabel: "ADD+DEL pair (ms, logarithmic)", YLabel: "share of pairs at or below", LogX: true}
		for _, name := range []string{"ipwarden", "host-local"} {
			d := slices.Clone(r.cni[name])
			slices.Sort(d)
			v := make([]float64, len(d))
			for i, x := range d {
				v[i] = ms(x)
			}
			c.Series = append(c.Series, charts.CDF(fmt.Sprintf("%s (p50 %s, p99 %s)", name,
				quantile(d, 0.5).Round(10*time.Microsecond), quantile(d, 0.99).Round(10*time.Microsecond)), v))
		}
		out = append(out, c)
	}
	if len(r.burst) > 0 {
		c := charts.Chart{File: "burst-ip-wait.svg",
			Title:  "IP wait of each ADD over the burst, by node (make bench, burst)",
			XLabel: "ADD sent, after the burst's first (ms)", YLabel: "IP wait: the ADD's answer (ms)"}
		nodes := make([]string, 0, len(r.burst))
		for n := range r.burst {
			nodes = append(nodes, n)
		}
		sort.Strings(nodes)
		for _, n := range nodes {
			s := charts.Series{Name: n, Dots: true}
			for _, a := range r.burst[n] {
				if a.wait > 0 {
					s.Points = append(s.Points, charts.Point{X: ms(a.at), Y: ms(a.wait)})
				}
			}
			c.Series = append(c.Series, s)
		}
		out = append(out, c)
	}
	return out
}

// write puts the text report and the pictures into dir and says where.
func (r *report) write(dir string) error {
	paths, err := charts.WriteReport(dir, r.text(), r.charts())
	if err != nil {
		return err
	}
	fmt.Printf("\nreport and pictures:\n")
	for _, p := range paths {
		fmt.Printf("  %s\n", p)
	}
	return nil
}
