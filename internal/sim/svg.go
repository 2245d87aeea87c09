package sim

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"
)

// Chart geometry, in SVG user units.
const (
	chartW    = 1000.0
	chartH    = 640.0
	plotLeft  = 80.0
	plotRight = chartW - 230.0 // room for the legend
	topY0     = 70.0           // address panel
	topY1     = 380.0
	botY0     = 440.0 // waiting pods panel
	botY1     = 590.0
)

// series colours.
const (
	colCapacity  = "#6b7280"
	colAllocated = "#f59e0b"
	colHeld      = "#2563eb"
	colInUse     = "#16a34a"
	colWaiting   = "#dc2626"
	colFailed    = "#7f1d1d"
	colExhausted = "#fee2e2"
)

// WriteSVG draws the run as a standalone SVG a browser opens: addresses (pool capacity,
// allocated, held by nodes, in use) over time on top, pods waiting for an address and failed
// pods below, with the time the pool was marked exhausted shaded.
func WriteSVG(w io.Writer, s Summary, series []Sample) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%g" height="%g" viewBox="0 0 %g %g" font-family="sans-serif" font-size="12">`+"\n",
		chartW, chartH, chartW, chartH)
	b.WriteString(`<rect width="100%" height="100%" fill="white"/>` + "\n")
	sc := s.Scenario
	title := fmt.Sprintf("ipwarden simulate: %d nodes, batch %d, buffer %d%%, maxPerNode %d, pool %d addresses",
		sc.Nodes, sc.BatchSize, sc.BufferPercent, sc.MaxPerNode, s.Pool.Capacity)
	text(&b, plotLeft, 24, "start", 15, "bold", title)
	workload := fmt.Sprintf("%g pods/node, churn %g/node/min", sc.PodsPerNode, sc.ChurnPerNodePerMinute)
	if sc.TraceEvents > 0 {
		workload = fmt.Sprintf("trace of %d events", sc.TraceEvents)
	}
	if sc.Burst > 0 {
		workload += fmt.Sprintf(", burst of %d at %s", sc.Burst, fmtSecs(sc.BurstAtSeconds))
	}
	sub := fmt.Sprintf("%s, %s start, cooldown %s, controller %d workers at %s per write, %g writes/s, seed %d",
		workload, sc.Start, fmtSecs(sc.ReuseCooldownSeconds), sc.ControllerWorkers, fmtSecs(sc.ControllerLatencySeconds), sc.KubeAPIQPS, sc.Seed)
	text(&b, plotLeft, 44, "start", 12, "normal", sub)
	if len(series) == 0 {
		b.WriteString("</svg>\n")
		_, err := w.Write(b.Bytes())
		return err
	}

	end := series[len(series)-1].At
	if end <= 0 {
		end = time.Second
	}
	xOf := func(d time.Duration) float64 { return plotLeft + (plotRight-plotLeft)*float64(d)/float64(end) }

	// Shade the time the pool was marked exhausted, in both panels.
	for i := 0; i < len(series); i++ {
		if !series[i].Exhausted {
			continue
		}
		j := i
		for j+1 < len(series) && series[j+1].Exhausted {
			j++
		}
		x0, x1 := xOf(series[i].At), xOf(series[min(j+1, len(series)-1)].At)
		for _, p := range [][2]float64{{topY0, topY1}, {botY0, botY1}} {
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`+"\n", x0, p[0], max(x1-x0, 1), p[1]-p[0], colExhausted)
		}
		i = j
	}

	// Addresses panel. The capacity line is drawn only when it does not flatten the others.
	var top float64
	for _, smp := range series {
		top = max(top, float64(smp.Allocated), float64(smp.Held), float64(smp.InUse))
	}
	capacity := float64(s.Pool.Capacity)
	showCap := capacity > 0 && capacity <= 3*top
	if showCap {
		top = max(top, capacity)
	}
	top = niceCeil(max(top*1.05, 1))
	axes(&b, topY0, topY1, top, end, "addresses")
	yTop := func(v float64) float64 { return topY1 - (topY1-topY0)*v/top }
	if showCap {
		line(&b, series, xOf, func(s Sample) float64 { return yTop(float64(s.Capacity)) }, colCapacity, "6 4")
	}
	line(&b, series, xOf, func(s Sample) float64 { return yTop(float64(s.Allocated)) }, colAllocated, "")
	line(&b, series, xOf, func(s Sample) float64 { return yTop(float64(s.Held)) }, colHeld, "")
	line(&b, series, xOf, func(s Sample) float64 { return yTop(float64(s.InUse)) }, colInUse, "")

	// Waiting pods panel.
	var bot float64
	for _, smp := range series {
		bot = max(bot, float64(smp.Waiting), float64(smp.FailedTotal))
	}
	bot = niceCeil(max(bot*1.05, 5)) // whole pods
	axes(&b, botY0, botY1, bot, end, "pods")
	yBot := func(v float64) float64 { return botY1 - (botY1-botY0)*v/bot }
	line(&b, series, xOf, func(s Sample) float64 { return yBot(float64(s.Waiting)) }, colWaiting, "")
	line(&b, series, xOf, func(s Sample) float64 { return yBot(float64(s.FailedTotal)) }, colFailed, "4 3")

	// X axis labels, shared.
	unit, div := "minutes", float64(time.Minute)
	if end < 5*time.Minute {
		unit, div = "seconds", float64(time.Second)
	}
	span := float64(end) / div
	step := niceStep(span / 8)
	for v := 0.0; v <= span+1e-9; v += step {
		x := plotLeft + (plotRight-plotLeft)*v/span
		text(&b, x, botY1+16, "middle", 11, "normal", fmtNum(v))
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#9ca3af"/>`+"\n", x, botY1, x, botY1+4)
	}
	text(&b, (plotLeft+plotRight)/2, botY1+34, "middle", 12, "normal", "simulated time ("+unit+")")

	// Legend.
	lx, ly := plotRight+20, topY0+8
	type entry struct{ col, dash, label string }
	entries := []entry{}
	if showCap {
		entries = append(entries, entry{colCapacity, "6 4", "pool capacity"})
	}
	entries = append(entries,
		entry{colAllocated, "", "allocated (held + cooling)"},
		entry{colHeld, "", "held by nodes"},
		entry{colInUse, "", "in use by pods"},
	)
	for _, e := range entries {
		legend(&b, lx, ly, e.col, e.dash, e.label)
		ly += 20
	}
	if !showCap {
		text(&b, lx, ly+4, "start", 11, "normal", "pool capacity "+strconv.FormatInt(s.Pool.Capacity, 10))
		text(&b, lx, ly+18, "start", 11, "normal", "(off the scale)")
		ly += 36
	}
	fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="22" height="10" fill="%s"/>`+"\n", lx, ly-4, colExhausted)
	text(&b, lx+28, ly+5, "start", 11, "normal", "pool exhausted")
	ly = botY0 + 8
	legend(&b, lx, ly, colWaiting, "", "pods waiting for an address")
	legend(&b, lx, ly+20, colFailed, "4 3", "failed pods (total)")

	b.WriteString("</svg>\n")
	_, err := w.Write(b.Bytes())
	return err
}

// axes draws a panel's frame, horizontal grid and y labels.
func axes(b *bytes.Buffer, y0, y1, top float64, _ time.Duration, label string) {
	fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="#9ca3af"/>`+"\n", plotLeft, y0, plotRight-plotLeft, y1-y0)
	step := niceStep(top / 5)
	for v := 0.0; v <= top+1e-9; v += step {
		y := y1 - (y1-y0)*v/top
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#e5e7eb"/>`+"\n", plotLeft, y, plotRight, y)
		text(b, plotLeft-6, y+4, "end", 11, "normal", fmtNum(v))
	}
	fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="12" transform="rotate(-90 %.1f %.1f)">%s</text>`+"\n",
		plotLeft-58, (y0+y1)/2, plotLeft-58, (y0+y1)/2, esc(label))
}

// line draws one series as a polyline.
func line(b *bytes.Buffer, series []Sample, x func(time.Duration) float64, y func(Sample) float64, col, dash string) {
	var pts strings.Builder
	for i, s := range series {
		if i > 0 {
			pts.WriteByte(' ')
		}
		fmt.Fprintf(&pts, "%.1f,%.1f", x(s.At), y(s))
	}
	da := ""
	if dash != "" {
		da = fmt.Sprintf(` stroke-dasharray="%s"`, dash)
	}
	fmt.Fprintf(b, `<polyline fill="none" stroke="%s" stroke-width="1.6"%s points="%s"/>`+"\n", col, da, pts.String())
}

func legend(b *bytes.Buffer, x, y float64, col, dash, label string) {
	da := ""
	if dash != "" {
		da = fmt.Sprintf(` stroke-dasharray="%s"`, dash)
	}
	fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="2"%s/>`+"\n", x, y, x+22, y, col, da)
	text(b, x+28, y+4, "start", 11, "normal", label)
}

func text(b *bytes.Buffer, x, y float64, anchor string, size int, weight, s string) {
	fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="%s" font-size="%d" font-weight="%s">%s</text>`+"\n", x, y, anchor, size, weight, esc(s))
}

func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s))
	return b.String()
}

// niceStep rounds a raw step up to 1, 2 or 5 times a power of ten.
func niceStep(raw float64) float64 {
	if raw <= 0 || math.IsNaN(raw) || math.IsInf(raw, 0) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

// niceCeil rounds v up to a multiple of a nice step, so the top grid line is the frame.
func niceCeil(v float64) float64 {
	step := niceStep(v / 5)
	return math.Ceil(v/step) * step
}

// fmtNum prints axis labels: 1500, 2.5, 120k, 1.2M.
func fmtNum(v float64) string {
	switch a := math.Abs(v); {
	case a >= 1e6:
		return strconv.FormatFloat(v/1e6, 'f', -1, 64) + "M"
	case a >= 1e4:
		return strconv.FormatFloat(v/1e3, 'f', -1, 64) + "k"
	default:
		return strconv.FormatFloat(math.Round(v*1000)/1000, 'f', -1, 64)
	}
}
